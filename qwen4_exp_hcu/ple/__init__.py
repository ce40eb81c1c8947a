"""Per-Layer-Embedding (PLE) layers: hash, INT8 table, lookup, layer, prefetch, ETP. No vLLM imports."""
