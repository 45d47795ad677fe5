"""Entry points: the offline LLM, the command line, the %llm magics and the OpenAI-compatible server."""
