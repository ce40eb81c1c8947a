"""Per-Layer-Embedding (PLE) layers: hash, storage, table, lookup, layer, prefetch, ETP. No vLLM imports."""
