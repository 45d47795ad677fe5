"""The worker: the model runner (a batch in, sampled tokens out) and the sampler."""
