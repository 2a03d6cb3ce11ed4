"""crl: CompactionRL as a TorchRL/TensorDict trainer (see docs/design.md and README.md)."""
__version__ = "0.1.0"
