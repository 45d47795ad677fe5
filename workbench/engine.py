"""LLMEngine: the steppable engine. One ``step()`` = schedule -> run the model -> sample -> outputs.

Every step appends a :class:`~workbench.history.StepRecord` to ``engine.history``, and the live
objects (``engine.scheduler``, ``engine.kv_cache``) stay inspectable between steps.
"""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Iterable

import torch

from workbench.config import EngineConfig, default_max_num_batched_tokens, default_max_num_seqs
from workbench.core.kv_cache import KVCacheManager
from workbench.core.scheduler import Scheduler
from workbench.history import StepHistory, StepRecord
from workbench.inputs import InputProcessor, PromptType
from workbench.model.loader import resolve_model_path
from workbench.model.model_config import ModelConfig
from workbench.outputs import OutputProcessor, RequestOutput
from workbench.request import Request, RequestStatus
from workbench.runner import ModelRunner
from workbench.sampling_params import SamplingParams
from workbench.stats import StatLogger


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class LLMEngine:
    """A continuous-batching engine over a paged KV cache, advanced one ``step()`` at a time.

    Invariants between steps: ``scheduler.requests`` holds exactly the unfinished requests;
    a request id is never reused while it is unfinished; finished and aborted requests own
    no KV blocks.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        model_path = resolve_model_path(config.model)
        self.tokenizer = _load_tokenizer(config.tokenizer or model_path)
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.model_config = ModelConfig.from_pretrained(
            model_path, dtype=config.dtype, max_model_len=config.max_model_len, device=self.device
        )
        max_model_len = self.model_config.max_model_len
        self.attention_backend = config.attention_backend or (
            "triton" if self.device.type == "cuda" else "cpu"
        )
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_max_num_batched_tokens(
            self.device.type, config.enable_chunked_prefill, max_model_len
        )
        self.runner = ModelRunner(
            self.model_config,
            device=self.device,
            block_size=config.block_size,
            attention_backend=self.attention_backend,
            load_format=config.load_format,
            seed=config.seed,
        )
        num_blocks = self.runner.determine_num_blocks(
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_kv_blocks=config.max_num_kv_blocks,
        )
        self.runner.allocate_kv_cache(num_blocks)
        max_num_seqs = config.max_num_seqs or default_max_num_seqs(self.device.type)
        if self.device.type == "cuda":  # compile every kernel variant before the first request
            self.runner.warm_up(max_num_seqs, self.max_num_batched_tokens)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.policy,
        )
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len, self.model_config.vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.history = StepHistory(config.max_history)
        self.stats = StatLogger(interval=config.log_stats_interval)
        self._children: dict[str, list[str]] = {}  # add_request id -> child request ids
        self._child_ids: set[str] = set()  # every child id in flight (queued or not yet)
        self._forks: dict[str, list[Request]] = {}  # child 0 id -> siblings not yet queued
        self._freed_mark = 0  # pool.num_freed at the end of the previous step
        self._pending_outputs: list[RequestOutput] = []
        #: False: step() returns a request's RequestOutput once, when it finishes (what LLM
        #: uses). True: every step returns a delta output (new text and token ids) for each
        #: request that got tokens, as a streaming server needs.
        self.stream_outputs = False
        # The tokenizer's eos ends a request; other eos ids of generation_config.json join
        # each request's stop_token_ids (as vLLM does), unless it ignores eos.
        eos = self.model_config.eos_token_ids
        self._eos_token_id = self.tokenizer.eos_token_id
        if self._eos_token_id is None and eos:
            self._eos_token_id = eos[0]
        self._extra_eos_ids = [t for t in eos if t != self._eos_token_id]

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError (nothing queued) on bad input.

        ``params.n > 1`` makes n child requests ``"{i}_{request_id}"`` reported as one
        RequestOutput. Child 0 is queued now; its siblings join the scheduler once child 0's
        prompt is computed, so they find its full prompt blocks in the prefix cache and share
        them instead of computing the prompt n times.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}.")
        if request_id in self._children:
            raise ValueError(f"request_id {request_id!r} is already in flight.")
        params = params or SamplingParams()
        text, token_ids, params = self.input_processor.process(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = dataclasses.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                stop_token_ids=params.stop_token_ids
                + ([] if params.ignore_eos else self._extra_eos_ids),
            )
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(
                Request(
                    child_id,
                    list(token_ids),
                    child_params,
                    eos_token_id=self._eos_token_id,
                    priority=priority,
                    arrival_time=arrival,
                )
            )
        clash = [c.request_id for c in children if c.request_id in self._child_ids]
        if clash:
            raise ValueError(f"request_id {clash[0]!r} is already in flight.")
        self.scheduler.add_request(children[0])  # raises (nothing queued) if it can never fit
        if len(children) > 1:
            self._forks[children[0].request_id] = children[1:]
        for i, child in enumerate(children):
            self.output_processor.add_request(
                child, text, parent_id=request_id if params.n > 1 else None, index=i, n=params.n
            )
        self._children[request_id] = [c.request_id for c in children]
        self._child_ids.update(self._children[request_id])

    def abort_request(self, request_id: str | Iterable[str], *, report: bool = True) -> None:
        """Abort requests (by the id given to add_request) in any state; frees their blocks.

        Their final outputs (finish_reason "abort") come out of the next ``step()``, unless
        ``report=False`` (a rollback of requests nobody has seen).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = [c for rid in ids for c in self._children.pop(rid, [])]
        self._child_ids.difference_update(child_ids)
        for c in child_ids:
            self._forks.pop(c, None)
        live = [c for c in child_ids if c in self.scheduler.requests]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for c in child_ids:
            self.runner.sampler.remove(c)
        outputs = self.output_processor.abort(child_ids, stream=self.stream_outputs)
        if report:
            self._pending_outputs.extend(outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self._children) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._children)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block's hash (only possible while no request holds blocks)."""
        return self.kv_cache.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step.

        Returns the RequestOutputs of requests that finished in it (and of aborts since the
        last step); with ``stream_outputs`` a delta output for every request that got tokens.
        ``history[-1]`` records the step; ``num_blocks_freed`` counts blocks released since the
        previous record (aborts in between included).
        """
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        timings = {"schedule": t1 - t0}
        sampled: dict[str, int] = {}
        logprobs = {}
        batch = None
        requests = self.scheduler.requests
        if so.scheduled:
            result = self.runner.execute(so, requests)
            sampled, logprobs, batch = result.sampled_token_ids, result.logprobs, result.batch
            timings.update(result.timings)
        t2 = time.perf_counter()
        updated = self.scheduler.update_from_output(so, sampled)  # sets token/finish times
        for request in updated:
            for sibling in self._forks.pop(request.request_id, ()):
                self.scheduler.add_request(sibling)
        outputs, stop_ids = self.output_processor.process(
            updated, logprobs, stream=self.stream_outputs
        )
        if stop_ids:
            self.scheduler.finish_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        finished = tuple(r.request_id for r in updated if r.is_finished)
        for request_id in finished:
            self.runner.sampler.remove(request_id)
        outputs = self._pending_outputs + outputs
        self._pending_outputs = []
        for out in outputs:
            if out.finished:
                self._child_ids.difference_update(self._children.pop(out.request_id, ()))
        timings["output"] = time.perf_counter() - t2
        record = StepRecord(
            step=so.step,
            scheduler_output=so,
            batch=batch,
            sampled_token_ids=sampled,
            finished_request_ids=finished,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv_cache.num_free_blocks,
            kv_usage=self.kv_cache.usage,
            num_blocks_freed=self.kv_cache.pool.num_freed - self._freed_mark,
            timings=timings,
        )
        self._freed_mark = self.kv_cache.pool.num_freed
        self.history.append(record)
        self.stats.record(prompt_tokens=record.num_prefill_tokens, generation_tokens=len(sampled))
        if self.config.log_stats:
            self.log_stats()
        return outputs

    def log_stats(self, force: bool = False) -> str | None:
        """Log (and return) vLLM's periodic summary line, at most once per interval unless forced."""
        prefix = self.kv_cache.prefix_cache_stats
        return self.stats.maybe_log(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.kv_cache.usage,
            prefix=(prefix.queries, prefix.hits),
            force=force,
        )

    def _repr_html_(self) -> str:
        mc, kv = self.model_config, self.kv_cache
        rows = {
            "model": f"{mc.architecture} ({html.escape(mc.path.name)}), {mc.num_layers} layers",
            "device / attention": f"{self.device.type} / {self.attention_backend}",
            "KV cache": f"{kv.num_blocks} blocks x {kv.block_size} tokens, "
                        f"{kv.num_free_blocks} free ({kv.usage:.0%} used)",
            "budget": f"{self.max_num_batched_tokens} tokens, {self.scheduler.max_num_seqs} seqs "
                      f"per step, policy {html.escape(self.scheduler.policy.name)}",
            "queues": f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting",
            "steps recorded": str(len(self.history)),
        }
        cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows.items())
        return f"<b>LLMEngine</b><table>{cells}</table>"

    def __repr__(self) -> str:
        mc = self.model_config
        return (
            f"LLMEngine(model={mc.architecture}, layers={mc.num_layers}, device={self.device.type}, "
            f"attention={self.attention_backend}, blocks={self.kv_cache.num_blocks}x"
            f"{self.kv_cache.block_size}, running={len(self.scheduler.running)}, "
            f"waiting={len(self.scheduler.waiting)}, steps={len(self.history)})"
        )
