"""Qwen4Exp with host-offloaded INT8 Per-Layer-Embedding tables, for vLLM and notebooks."""
