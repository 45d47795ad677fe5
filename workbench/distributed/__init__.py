"""What crosses between engines: the KV connector (prefill/decode disaggregation), as vLLM's
``vllm/distributed``."""
