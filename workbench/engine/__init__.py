"""The engine: LLMEngine and AsyncLLM, input and output processing, the step history."""
