"""Ground helpers every layer may use and that import nothing of the project: host <-> device
copies (transfer.py), CUDA-graph capture (graphs.py), the on-disk cache (cache.py)."""
