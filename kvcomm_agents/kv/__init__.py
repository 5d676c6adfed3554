"""KV assets: the one block layout, exact RoPE re-rotation, segments, the store, own-text KV.

Engine-neutral: tensors and token ids only (no transformers, no chat messages).
"""
