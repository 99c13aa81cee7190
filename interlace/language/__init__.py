"""Device side: Triton helpers for communication inside kernels."""
