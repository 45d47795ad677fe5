"""The model-independent core: KV-cache bookkeeping and scheduling. Imports nothing from model/runner."""
