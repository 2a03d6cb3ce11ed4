"""Model presets: tiny Llama/Qwen2-style architectures built from ``transformers`` configs (no download).

Plain data, importable without torch, so that loading a config can check ``model.preset`` cheaply.
"""
PRESETS = {
    # ~0.1M parameters: the CPU test and default-training preset.
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
    "qwen2-tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
    # ~0.3M parameters: the default training preset; full multi-head attention and 3 layers learn to copy a fact
    # from the context within ~150 warm-start steps, which llama-tiny does not (measured: docs in README).
    "llama-mini": dict(model_type="llama", hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=4),
    # ~1M parameters: a still-CPU-friendly larger preset.
    "llama-small": dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=4),
}
