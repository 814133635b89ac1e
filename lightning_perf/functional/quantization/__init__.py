"""Quantization: QAT and dynamic int8 preparation, float8 training."""
