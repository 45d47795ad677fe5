"""llm-workbench: a steppable, inspectable re-implementation of vLLM's serving path."""

from workbench.config import EngineConfig
from workbench.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
