"""Triton and ninetoothed kernels."""
