"""Attention: detecting attention modules and swapping them for fused kernels."""
