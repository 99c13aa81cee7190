"""Compute kernels (Triton): they take wait tables and tile orders and emit signals."""
