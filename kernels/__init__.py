"""Triton kernels used by the pools, each with a plain-torch reference."""
