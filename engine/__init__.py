"""The serving engine between the nodes and the models: paged KV cache (kv_cache.py), the
Llama modules on it behind the CausalLM interface (paged_lm.py)."""
