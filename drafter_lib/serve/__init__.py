"""The HTTP drafter service: FastAPI app, request schema, micro-batching, metrics, and its client."""
