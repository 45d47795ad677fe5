"""Pooling models as vLLM runs them (``runner="pooling"``, ``convert="embed"``): the pooler's
config, the engine's pooling requests and their outputs. The torch side (the pooler itself)
is :mod:`workbench.model.pooler`."""
