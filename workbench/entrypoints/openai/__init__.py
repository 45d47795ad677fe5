"""The OpenAI-compatible HTTP layer (FastAPI): requests in, SSE or JSON out; it drives an AsyncLLM only."""
