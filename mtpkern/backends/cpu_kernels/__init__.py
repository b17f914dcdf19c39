"""Numba CPU kernels, one module per kernel family (see mtpkern.ops)."""
