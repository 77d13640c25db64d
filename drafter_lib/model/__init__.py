"""The hand-written decoder (Llama family and Qwen3), its KV cache, loading HF models, tiny random models, draft
vocabularies."""
