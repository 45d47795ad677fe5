"""LLM: vLLM's offline entry point (generate / chat) over a steppable LLMEngine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.entrypoints.beam_search import BeamSearchOutput, beam_search, check_beam_width
from workbench.engine.llm_engine import LLMEngine
from workbench.config import EngineArgs
from workbench.utils.heap import frozen_heap, rare_collections
from workbench.engine.input_processor import PromptType
from workbench.entrypoints.llm_pooling import PoolingMixin
from workbench.lora.request import LoRARequest
from workbench.outputs import RequestOutput
from workbench.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = Sequence[Mapping[str, str]]


class LLM(PoolingMixin):
    """Offline batched generation. ``LLM()`` loads the embedded default model.

    Keyword arguments are :class:`~workbench.config.EngineArgs` (EngineConfig) fields.
    ``llm.engine`` is the LLMEngine behind it: step it yourself, or inspect
    ``llm.engine.history`` after a run. ``generate``/``chat`` ask for FINAL_ONLY outputs.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        # vLLM's LLM turns stat logging off unless told (disable_log_stats=True): offline
        # batches need no periodic stats line. An engine built directly logs them (vLLM's).
        kwargs.setdefault("log_stats", False)
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._num_added = 0  # request ids are gen-0, gen-1, ... in the order of adding

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for :attr:`engine`."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one SamplingParams for all prompts or one per prompt.
        ``lora_request``: one adapter for all prompts or one per prompt (None: the base model).
        If any prompt is invalid, a ValueError names it and nothing is generated.
        """
        if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._broadcast(sampling_params, len(prompts), "sampling_params")
        priorities = self._broadcast(priority or 0, len(prompts), "priority")
        return self._run(prompts, params, priorities, use_tqdm,
                         self._broadcast_lora(lora_request, len(prompts)))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the tokenizer's chat
        template, given ``tools`` and ``chat_template_kwargs`` as vLLM's ``LLM.chat``; the
        reply is text: tool calls are parsed by the server)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        processor = self.engine.input_processor
        kwargs = {**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})}
        prompts = []
        for conversation in conversations:
            text = processor.render_chat(
                conversation, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                chat_template_kwargs=kwargs,
            )
            ids = self.engine.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params = self._broadcast(sampling_params, len(prompts), "sampling_params")
        return self._run(prompts, params, [0] * len(prompts), use_tqdm,
                         self._broadcast_lora(lora_request, len(prompts)))

    @staticmethod
    def _broadcast_lora(value, n: int) -> list:
        if value is None or isinstance(value, LoRARequest):
            return [value] * n
        value = list(value)
        if len(value) != n:
            raise ValueError(f"lora_request has {len(value)} entries but there are {n} prompts.")
        return value

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's beam search (:mod:`workbench.entrypoints.beam_search`), driven above the engine:
        each step runs one ``max_tokens=1`` request per live beam of every prompt, so
        ``engine.history`` shows the steps and the prefix cache the beams' shared blocks.
        A prompt is a string, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``; each
        is validated before anything runs: ``prompt + max_tokens`` must fit the context and
        the KV cache."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        processor = self.engine.input_processor
        check_beam_width(params.beam_width, processor.max_logprobs)
        prompt_ids = []
        for i, prompt in enumerate(prompts):
            try:
                request = processor.process_inputs("beam-search", prompt, SamplingParams(max_tokens=1))
                processor.check_context_length(len(request.prompt_token_ids), params.max_tokens)
                self.engine.scheduler.check_fits("beam-search", len(request.prompt_token_ids),
                                                 params.max_tokens)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from exc
            prompt_ids.append(request.prompt_token_ids)
        tokenizer = self.engine.tokenizer
        return beam_search(
            lambda batch, sp: self.generate(batch, sp, use_tqdm=False),
            prompt_ids, params, tokenizer.eos_token_id, tokenizer.decode,
        )

    @staticmethod
    def _broadcast(value, n: int, name: str) -> list:
        if value is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(value, (SamplingParams, int)):
            return [value] * n
        value = list(value)
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts.")
        return value

    def _run(self, prompts, params, priorities, use_tqdm: bool, loras) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.engine
        if "generate" not in engine.supported_tasks:  # vLLM's check and words
            raise ValueError("LLM.generate() is only supported for generative models. Try passing "
                             "`--runner generate` to use the model as a generative model.")
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        requests = []
        for i, (prompt, p, prio, lora) in enumerate(zip(prompts, params, priorities, loras)):
            try:  # every prompt processed (once) before any is added
                requests.append(engine.input_processor.process_inputs(
                    f"gen-{self._num_added + i}", prompt, p, priority=prio, lora_request=lora))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from exc
        ids = []
        try:
            for request in requests:
                self._num_added += 1  # an id is used up once its add was tried
                engine.add_request(request.request_id, request)
                ids.append(request.request_id)
        except ValueError:
            engine.abort_request(ids)
            raise
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        # As the drivers run the engine: its step records join the frozen heap between steps,
        # and young collections are rare (a step allocates thousands of short-lived objects).
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar, \
                rare_collections(), frozen_heap() as refreeze:
            while len(results) < len(ids):
                refreeze()
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    # vLLM's LLM methods for sleep mode and profiling: the engine's, documented there.
    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def start_profile(self, directory: str | None = None) -> None:
        self.engine.start_profile(directory)

    def stop_profile(self):
        return self.engine.stop_profile()

    def __repr__(self) -> str:
        return f"LLM({self.engine!r})"

    def _repr_html_(self) -> str:
        return self.engine._repr_html_()
