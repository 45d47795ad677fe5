"""Speculative decoding's proposers: n-gram prompt lookup and a draft model (vLLM's
``vllm/v1/spec_decode``); the target's verification is the worker's RejectionSampler."""
