"""specdraft: train, pack and serve small drafters for speculative decoding."""
