"""RequestLogger (vLLM's ``--enable-log-requests``, ``--max-log-len``): one INFO line per engine
request the server makes, its prompt and token ids cut to ``max_log_len``."""

from __future__ import annotations

import logging

logger = logging.getLogger("workbench.entrypoints.openai.request_logger")


class RequestLogger:
    """Logs each engine request's inputs as vLLM's does (``max_log_len``: None keeps them whole)."""

    def __init__(self, *, max_log_len: int | None = None) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}.")
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                   params, lora_request=None) -> None:
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "prompt_embeds shape: %s, lora_request: %s.", request_id, prompt, params,
                    prompt_token_ids, None, lora_request)
