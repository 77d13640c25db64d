"""Greedy generation and speculative decoding on the hand-written decoder and on transformers models."""
