"""Acceptance under greedy verification against baselines, and expected/measured speed-up."""
