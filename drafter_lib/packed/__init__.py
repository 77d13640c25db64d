"""The packed model directory: what the study ships and the engine loads (config, quantization, weights,
copy policy)."""
