"""Triton kernels (CUDA/ROCm, and CPU under TRITON_INTERPRET=1). Each has a torch reference beside its caller."""
