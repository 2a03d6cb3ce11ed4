"""crl: CompactionRL as a TorchRL/TensorDict trainer (see DESIGN.md in the project's shared notes and README.md)."""
__version__ = "0.1.0"
