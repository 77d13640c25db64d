"""Drafter training: distillation on teacher continuations, then quantization-aware training."""
