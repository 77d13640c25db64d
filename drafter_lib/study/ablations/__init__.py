"""Ablations of the study: kept layers, draft vocabulary, loss, data."""
