"""Model runtimes. :mod:`.hf` is the only module that touches transformers' caches and forward."""
