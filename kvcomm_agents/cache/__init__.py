"""KV cache assets: segments, the store, RoPE re-rotation, assembly and the transformers seam."""
