"""Native Llama-family models that read Hugging Face checkpoints and attend over the paged KV cache."""
