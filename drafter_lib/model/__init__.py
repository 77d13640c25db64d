"""The hand-written decoder (Llama family, Qwen2 and Qwen3), its KV cache, loading HF models, tiny random models, draft
vocabularies."""
