"""LLMEngine: the steppable engine. One ``step()`` = schedule -> run the model -> sample -> outputs.

Every step appends a :class:`~workbench.engine.history.StepRecord` to ``engine.history``, and the live
objects (``engine.scheduler``, ``engine.kv_cache``) stay inspectable between steps.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from workbench.config import EngineConfig, default_max_num_batched_tokens, default_max_num_seqs
from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.explain import explain_stats
from workbench.core.sched.scheduler import Scheduler
from workbench.core.sched.async_scheduler import PLACEHOLDER_TOKEN_ID, AsyncScheduler
from workbench.engine.batch_queue import BatchQueue, InFlight, StepOverlap
from workbench.core.sched.output import SchedulerOutput
from workbench.distributed.kv_transfer.factory import create_kv_connector
from workbench.engine.history import StageTimer, StepHistory, StepRecord
from workbench.worker.device import engine_device
from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.fork import fork_engine
from workbench.engine.idle import IdleWaiter
from workbench.engine.input_processor import InputProcessor, PromptType, check_request_id
from workbench.model.loader import resolve_model_path
from workbench.model.model_config import ModelConfig
from workbench.model.tokenizer import load_tokenizer
from workbench.engine.output_processor import OutputProcessor, StepOutputs
from workbench.outputs import RequestOutput
from workbench.engine.parallel_sampling import ParentRequest
from workbench.engine.pooling_requests import PoolingRequests
from workbench.pooling.config import supported_tasks
from workbench.pooling_params import PoolingParams
from workbench.lora.request import LoRARequest
from workbench.request import Request, RequestStatus
from workbench.metrics.request_tracker import RequestTracker
from workbench.metrics.tracing import RequestTracer, log_tracing_disabled_warning
from workbench.worker.runner_output import RunnerOutput
from workbench.worker.run_method import run_method
from workbench.worker.runner_protocol import Runner, RunnerFactory
from workbench.sampling_params import SamplingParams
from workbench.reasoning import ReasoningParserManager
from workbench.worker.logits_processor import LogitsProcessors, load_logits_processors
from workbench.spec_decode.proposer import make_proposer
from workbench.structured_output.manager import StructuredOutputManager
from workbench.metrics.stats import (IterationStats, KVConnectorStats, LoggingStatLogger, SchedulerStats,
                                     SpecDecodingStats, StatLoggerBase)

if TYPE_CHECKING:
    from workbench.config import EngineArgs

logger = logging.getLogger(__name__)


class LLMEngine:
    """A continuous-batching engine over a paged KV cache, advanced one ``step()`` at a time.

    Invariants between steps: ``scheduler.requests`` holds exactly the unfinished requests
    that were handed to the scheduler; ``output_processor.parents`` holds every request id
    added and not yet reported finished (an id is never reused while it is there); finished,
    failed and aborted requests own no KV blocks.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        make_runner: RunnerFactory | None = None,
        clock: Callable[[], float] | None = None,
        **overrides,
    ) -> None:
        """``make_runner`` builds the :class:`~workbench.worker.runner_protocol.Runner` (default
        ``ModelRunner``; ``SimulatedRunner.factory(...)`` of :mod:`workbench.lab.sim` predicts time instead);
        ``clock`` is the source of every request timestamp (default ``time.monotonic``)."""
        config = config or EngineConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        model_path = resolve_model_path(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        reasoner = None  # structured outputs start once its reasoning ends (vLLM's rule)
        if config.reasoning_parser is not None:
            try:
                parser = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
            reasoner = parser(self.tokenizer)
        if make_runner is None:  # the model itself: torch is imported only when one runs
            from workbench.worker.model_runner import ModelRunner

            make_runner = ModelRunner
        #: A torch.device; a SimulatedDevice with a simulated runner (workbench.worker.device).
        self.device = engine_device(config.device, make_runner)
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
        self.clock = clock or time.monotonic
        #: The custom logits processors' classes (``config.logits_processors``, loaded here).
        self.logits_processor_classes = load_logits_processors(config.logits_processors or ())
        if self.logits_processor_classes and config.speculative_config is not None:
            raise ValueError("logits_processors: custom logits processors are not supported with "
                             "speculative_config (their batch state follows one row per request; "
                             "verification samples several).")
        self.runner: Runner = make_runner(
            self.model_config,
            device=self.device,
            block_size=config.block_size,
            attention_backend=self.attention_backend,
            load_format=config.load_format,
            seed=config.seed,
            batch_invariant=config.batch_invariant,
        )
        #: The KV connector's scheduler side (``kv_transfer_config``; its worker side wraps
        #: the runner), else None.
        self.kv_connector = None
        if config.kv_transfer_config is not None:
            self.kv_connector, self.runner = create_kv_connector(
                config.kv_transfer_config, self.model_config, config.block_size, self.runner, self.clock)
        if self.logits_processor_classes:  # one instance each, for the runner's sampler
            self.runner.set_logits_processors(LogitsProcessors(
                [cls(config, self.device, False) for cls in self.logits_processor_classes]))
        num_blocks = self.runner.determine_num_blocks(
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_kv_blocks=config.max_num_kv_blocks,
        )
        self.runner.allocate_kv_cache(num_blocks)
        #: The LoRA adapters added, by id (``add_lora`` or a request's ``lora_request``).
        self.lora_requests: dict[int, LoRARequest] = {}
        if config.enable_lora:
            self.runner.enable_lora(max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                    max_cpu_loras=config.max_cpu_loras or config.max_loras)
        max_num_seqs = config.max_num_seqs or default_max_num_seqs(self.device.type)
        if self.device.type == "cuda":  # compile every kernel variant before the first request
            self.runner.warm_up(max_num_seqs, self.max_num_batched_tokens)
        self.kv_cache = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, record_events=True
        )
        # The grammars of constrained requests (structured outputs), compiled off this thread:
        # the scheduler owns them, as in vLLM V1.
        structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size,
            config=config.structured_outputs_config, reasoner=reasoner)
        self.scheduler = (AsyncScheduler if config.async_scheduling else Scheduler)(
            self.kv_cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.policy,
            record_events=True,
            clock=self.clock,
            max_loras=config.max_loras if config.enable_lora else None,
            structured_output_manager=structured_output_manager,
            connector=self.kv_connector,
        )
        #: Async scheduling's batch queue of two (``async_scheduling``), else None.
        # On a caller's clock (a simulation) batches run inline, so time is read in step order.
        self.batch_queue = BatchQueue(self.runner, inline=clock is not None) if config.async_scheduling else None
        if self.batch_queue is not None and self.logits_processor_classes:
            self.scheduler.always_pending = True  # batch-level processors read every row's outputs
        #: Speculative decoding's proposer (``speculative_config``), else None.
        self.proposer = make_proposer(config.speculative_config, self.model_config, self.tokenizer,
                                      device=self.device, block_size=config.block_size,
                                      attention_backend=self.attention_backend,
                                      num_blocks=num_blocks, load_format=config.load_format,
                                      seed=config.seed)
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len, self.model_config.vocab_size,
            max_logprobs=config.max_logprobs, eos_token_ids=self.model_config.eos_token_ids,
            policy=self.scheduler.policy, logits_processors=self.logits_processor_classes,
            enable_lora=config.enable_lora,
            structured_outputs_config=config.structured_outputs_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer,
                                                finish_request=self.scheduler.finish_from_output)
        #: The pooling requests in flight (``PoolingParams``): prefill-only, pooled by the runner.
        self.pooling = PoolingRequests(config.pooler_config, config.model or model_path.name,
                                       self.model_config.hf_config)
        #: vLLM's ``supported_tasks``: what ``LLM`` and the server offer (the engine itself runs
        #: generation and pooling requests side by side, so their interaction can be studied).
        self.supported_tasks = supported_tasks(config.runner, config.pooler_config)
        self.history = StepHistory(config.max_history, initial_kv_state=self.kv_cache.snapshot())
        self.request_tracker = RequestTracker()
        #: Callables ``fn(record)`` run after every step, in order; one that raises is logged
        #: and skipped, never breaking the step.
        self.on_step: list[Callable[[StepRecord], object]] = []
        #: Loggers fed every step (``record``) and on ``do_log_stats`` (``log``), by name.
        self.stat_loggers: dict[str, StatLoggerBase] = (
            {"logging": LoggingStatLogger()} if config.log_stats else {}
        )
        #: The scheduler and KV cache after the latest step: ``history[-1].scheduler_stats``.
        self.scheduler_stats = SchedulerStats(
            num_free_blocks=num_blocks, kv_cache_usage=self.kv_cache.usage
        )
        self._last_log_time = time.monotonic()
        self._unrecorded_aborts = False  # aborts since the last step (abort_request)
        self._step_end: float | None = None  # when the last step left unfinished work (perf_counter)
        #: How a driver waits for requests: keeping a CPU's worker threads awake (workbench.engine.idle).
        self.idle = IdleWaiter(self.device, config.keep_warm_s)
        #: The latest :class:`~workbench.engine.profiler.EngineProfiler` (start_profile), else None.
        self.profiler = None
        #: The OpenTelemetry request tracer (``otlp_traces_endpoint``), else None: no cost per step.
        self.tracer: RequestTracer | None = None
        if config.otlp_traces_endpoint:
            self.tracer = RequestTracer.from_endpoint(
                config.otlp_traces_endpoint, config.model or model_path.name, self.clock,
                collect_detailed_traces=config.collect_detailed_traces)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: Mapping[str, StatLoggerBase] | None = None
    ) -> LLMEngine:
        """vLLM's constructor: an engine from :class:`~workbench.config.EngineArgs`,
        with extra stat loggers by name: they join the default one, as vLLM V1's
        StatLoggerManager adds custom loggers to its own (the V0 seed replaced them); with
        ``log_stats=False`` they are refused (``add_logger``'s RuntimeError)."""
        engine = cls(engine_args.create_engine_config())
        for name, stat_logger in (stat_loggers or {}).items():
            engine.add_logger(name, stat_logger)
        return engine

    # ------------------------------------------------------------------ accessors
    def get_engine_config(self) -> EngineConfig:
        """The EngineConfig this engine was built from (vLLM's ``get_vllm_config``)."""
        return self.config

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc``: ``method`` run on each worker -- here the one runner --
        returning their results (``timeout`` is accepted for vLLM's signature: one worker in
        this thread answers or raises)."""
        return [run_method(self.runner, method, args, kwargs)]

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        """Process and queue a request (vLLM's signature). Raises ValueError, with nothing
        queued, on bad input; TypeError (vLLM's) when ``request_id`` is not a string or
        ``params`` is not a SamplingParams (required, as vLLM: no default is made up).

        ``prompt`` may be an :class:`~workbench.engine.engine_core_request.EngineCoreRequest`
        processed already (``InputProcessor.process_inputs``): it is queued as it is, the
        other arguments unused, and this engine neither tokenizes nor decodes anything.
        ``arrival_time`` is in the engine's ``clock`` seconds (``time.monotonic()``; default: now).
        ``tokenization_kwargs`` may hold ``add_special_tokens``. ``params.n > 1`` makes n
        child sequences ``"{i}_{request_id}"`` reported as one RequestOutput
        (see :class:`~workbench.engine.parallel_sampling.ParentRequest`).
        ``lora_request`` runs it under that LoRA adapter (``enable_lora``), loaded here first
        if it is not yet: a bad adapter raises ValueError naming the file, nothing queued.
        """
        check_request_id(request_id)  # first, as vLLM's add_request
        if self.is_sleeping():
            raise ValueError("The engine is sleeping: wake_up() before adding requests.")
        if isinstance(prompt, EngineCoreRequest):
            if request_id != prompt.request_id:
                raise ValueError(f"request_id {request_id!r} differs from the EngineCoreRequest's "
                                 f"{prompt.request_id!r}.")
            request = prompt
        elif isinstance(params, PoolingParams):
            request = self.pooling.process_inputs(
                self.input_processor, request_id, prompt, params, arrival_time=arrival_time,
                lora_request=lora_request, tokenization_kwargs=tokenization_kwargs,
                trace_headers=trace_headers, priority=priority)
        else:
            request = self.input_processor.process_inputs(
                request_id, prompt, params, arrival_time=arrival_time, lora_request=lora_request,
                tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                priority=priority,
            )
        lora = request.lora_request
        if lora is not None:
            if not self.config.enable_lora:
                raise ValueError(f"Got lora_request {lora} but LoRA is not enabled!")
            pinned = self.scheduler.pinned_loras
            if lora.lora_name not in pinned and len(pinned) >= self.config.max_loras:
                raise ValueError(f"lora_request {lora}: all max_loras={self.config.max_loras} device "
                                 f"slots hold pinned adapters {sorted(pinned)}; it could never run.")
            self.add_lora(lora)
        if request.pooling_params is not None:  # prefill-only; no output processing
            if request.request_id in self.output_processor.parents:
                raise ValueError(f"request_id {request.request_id!r} is already in flight.")
            self.pooling.add(request, self.scheduler,
                             self.clock() if request.arrival_time is None else request.arrival_time)
            return
        parent = ParentRequest(
            request.request_id, request.prompt, request.prompt_token_ids,
            request.sampling_params, eos_token_id=request.eos_token_id, priority=request.priority,
            arrival_time=self.clock() if request.arrival_time is None else request.arrival_time,
            cache_salt=request.cache_salt, lora_request=request.lora_request,
        )
        self.output_processor.add_request(parent)  # the one check of an id in flight
        try:
            # Raises (nothing queued) if it can never fit. Its siblings join once it computed
            # the prompt, to share the prompt's blocks through the prefix cache.
            self.scheduler.add_request(parent.children[0])
        except ValueError:
            self.output_processor.discard(request.request_id)
            raise
        if self.tracer is not None:
            self.tracer.add_request(request.request_id, parent.children, request.trace_headers)
        elif request.trace_headers:
            log_tracing_disabled_warning()

    # ------------------------------------------------------------------ LoRA (vLLM's API)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into host memory (``max_cpu_loras``, LRU); False if its id is loaded
        already. A bad adapter raises ValueError naming the file; nothing in flight changes."""
        added = self.runner.add_lora(lora_request)
        self.lora_requests[lora_request.lora_int_id] = lora_request
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if it was not loaded (requests using it reload it)."""
        lora = self.lora_requests.pop(lora_id, None)
        if lora is not None:
            self.scheduler.pinned_loras.discard(lora.lora_name)
        return self.runner.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded in host memory."""
        return self.runner.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter in its device slot and host memory, never evicted; it counts
        against ``max_loras`` in every step from now on. ValueError when it is not loaded, or
        when the running requests' adapters and the pinned ones leave no slot for it."""
        lora = self.lora_requests.get(lora_id)
        if lora is None or lora_id not in self.runner.list_loras():
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        taken = {r.lora_name for r in self.scheduler.running if r.lora_request is not None}
        taken |= self.scheduler.pinned_loras
        if lora.lora_name not in taken and len(taken) >= self.config.max_loras:
            raise ValueError(f"Pinning failed. LoRA {lora_id}: the max_loras={self.config.max_loras} "
                             f"device slots are taken by {sorted(taken)} (running or pinned).")
        pinned = self.runner.pin_lora(lora_id)
        self.scheduler.pinned_loras.add(lora.lora_name)
        return pinned

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (by the id given to add_request) in any state; frees their blocks.

        vLLM's rule: an aborted request is gone at once and produces no output;
        ``has_unfinished_requests()`` no longer counts it. Unknown or finished ids are ignored.
        The abort itself (its RequestFinished event, the freed blocks, the "abort" count of the
        stat loggers) is recorded by the next ``step()``, as every change made between steps:
        a driver that wants ``history`` and the views to show it while nothing else is left
        to run steps once more (:meth:`has_unrecorded_aborts` says when).
        """
        self._abort(request_id)

    def _abort(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort; return the final outputs (finish_reason "abort") nobody else gets. AsyncLLM
        hands them to the requests' streams, as vLLM V1's output processor puts a final abort
        output on an AsyncLLM request's queue (``OutputProcessor.abort_requests``) while
        LLMEngine's ``step()`` returns none."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        pooled = self.pooling.abort(ids)
        self.scheduler.finish_requests([o.request_id for o in pooled], RequestStatus.FINISHED_ABORTED,
                                       now=self.clock())
        if pooled or any(rid in self.output_processor.parents for rid in ids):
            # Set before the requests leave: a reader on another thread (a notebook polling a
            # served engine) sees them unfinished or unrecorded, never neither.
            self._unrecorded_aborts = True
        child_ids = self.output_processor.child_ids(ids)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED, now=self.clock())
        if self.proposer is not None:
            self.proposer.remove(child_ids)
        return self.output_processor.abort(ids) + pooled

    def has_unrecorded_aborts(self) -> bool:
        """Whether requests were aborted since the last ``step()``, which has not recorded them
        yet (in its StepRecord's events and the stat loggers); see :meth:`abort_request`."""
        return self._unrecorded_aborts

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self.pooling.requests)

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests() + len(self.pooling.requests)

    @property
    def uses_priority(self) -> bool:
        """Whether the scheduling policy reads ``Request.priority`` (its
        :attr:`~workbench.core.sched.policies.SchedulingPolicy.uses_priority`)."""
        return self.scheduler.policy.uses_priority

    def get_unfinished_request_ids(self) -> list[str]:
        """The ids (as given to ``add_request``) of every request not finished yet."""
        return list(self.output_processor.parents) + list(self.pooling.requests)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode``): level 1 keeps the weights in host memory
        and frees the KV cache, level 2 frees both (see :mod:`workbench.worker.sleep_mode`).
        The prefix cache is reset first, which needs every request finished or aborted
        (RuntimeError otherwise, nothing changed). Asleep already: a warning, nothing done.
        Without ``enable_sleep_mode``: AssertionError, vLLM's (see :meth:`_check_sleep_mode`)."""
        self._check_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}.")
        if self.is_sleeping():
            logger.warning("Executor is already sleeping.")
            return
        if self.has_unfinished_requests() or not self.reset_prefix_cache():
            raise RuntimeError(
                "Failed to reset prefix cache because some blocks "
                f"({self.kv_cache.num_blocks - self.kv_cache.num_free_blocks}) are not freed yet: sleep() "
                f"needs every request finished or aborted ({self.get_num_unfinished_requests()} in flight).")
        self.runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what sleeps: ``tags`` "weights", "kv_cache" or both (None), in any order.
        Without ``enable_sleep_mode``: AssertionError, as :meth:`sleep`."""
        from workbench.worker.sleep_mode import TAGS as SLEEP_TAGS

        self._check_sleep_mode()
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"tags: unknown {unknown}; known: {list(SLEEP_TAGS)}.")
        self.runner.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping()

    def _check_sleep_mode(self) -> None:
        """vLLM's LLMEngine asserts ``enable_sleep_mode`` in both ``sleep`` and ``wake_up``;
        raised explicitly here, so that ``python -O`` keeps the check."""
        if not self.config.enable_sleep_mode:
            raise AssertionError("Sleep mode is not enabled in the model config")

    def start_profile(self, directory: str | None = None) -> None:
        """Start ``torch.profiler`` over the following steps, the engine's stages as ranges
        (see :mod:`workbench.engine.profiler`); ``directory`` (default ``torch_profiler_dir``)
        receives the trace at :meth:`stop_profile`."""
        from workbench.engine.profiler import EngineProfiler

        directory = directory or self.config.torch_profiler_dir
        if directory is None:
            raise ValueError("start_profile: no trace directory: set torch_profiler_dir "
                             "(--torch-profiler-dir) or pass start_profile(directory=...).")
        if self.profiler is not None and self.profiler.is_running:
            raise RuntimeError("The profiler is already running: stop_profile() first.")
        self.profiler = EngineProfiler(self, directory)
        self.profiler.start()

    def stop_profile(self):
        """Stop the profiler; write its trace (the torch profile beside the profiled steps'
        engine timeline) and print the top operators. Returns the trace's path."""
        if self.profiler is None or not self.profiler.is_running:
            raise RuntimeError("The profiler is not running: start_profile() first.")
        return self.profiler.stop()

    def is_tracing_enabled(self) -> bool:
        """Whether finished requests become OpenTelemetry spans (vLLM's name)."""
        return self.tracer is not None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block's hash (only possible while no request holds blocks)."""
        return self.kv_cache.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step, as vLLM's ``EngineCore.step``: schedule (with the grammar bitmask) ->
        execute and sample -> update the requests -> process the outputs -> record.

        Returns a RequestOutput for every request that progressed (per its
        ``SamplingParams.output_kind``: CUMULATIVE by default, DELTA, FINAL_ONLY); an aborted
        request gives none (vLLM's rule), but the step records the aborts made since the last
        one. A request whose own processing raises (sampling, logits processors,
        detokenization, stop strings) finishes with finish_reason "error" and
        ``RequestOutput.error``; the others are unaffected. So does one whose grammar refuses
        the token it sampled, whose output (as in vLLM) still holds that token. Only a failure
        of the whole batch (the forward pass) propagates, after its step is recorded.
        The scheduler writes every finish, at the step's one output time (``clock()`` after
        the forward). ``history[-1]`` records the step (see :meth:`_record` for its timings).
        With ``async_scheduling`` it is :meth:`step_with_batch_queue` (while requests or a step
        in flight remain).
        """
        if self.batch_queue is not None and (self.batch_queue or self.scheduler.has_unfinished_requests()):
            return self.step_with_batch_queue()
        timer = StageTimer(self._step_end)
        scheduler_output = self.scheduler.schedule()
        grammar_bitmask = self.scheduler.get_grammar_bitmask(scheduler_output)
        timer.lap("schedule")
        try:
            runner_output = self.runner.execute(scheduler_output, self.scheduler.requests, grammar_bitmask)
        except BaseException:  # the batch as a whole failed: record the step, nothing sampled
            self._observe(self._record(scheduler_output, timer))
            raise
        timer.add(runner_output.timings)
        updated, processed = self._update_and_process(scheduler_output, runner_output, timer)
        self._propose_drafts(updated)
        timer.lap("propose")
        self._observe(self._record(scheduler_output, timer, runner_output, processed.stats))
        return processed.outputs

    def step_with_batch_queue(self) -> list[RequestOutput]:
        """``step()`` with async scheduling, as vLLM's ``EngineCore.step_with_batch_queue`` (a
        batch queue of two: :mod:`workbench.engine.batch_queue`): schedule until two steps are
        in flight, then finish the oldest -- wait for its batch, update, process, record -- and
        return its outputs, while the newer one's forward runs. Each record's ``overlap`` says
        what ran under what. When no request is left, the step still in flight (its tokens
        dropped: a stop found one step late) is finished and recorded too."""
        queue = self.batch_queue
        while self.scheduler.has_unfinished_requests() and not queue.full:
            self._schedule_ahead()
        entry = queue.pop()
        timer = StageTimer(self._step_end)
        try:
            runner_output, forward = entry.future.result()
        except BaseException:  # the batch as a whole failed: record the step, nothing sampled
            self._observe(self._record(entry.scheduler_output, timer, overlap=self._overlap(entry)))
            raise
        timer.lap("wait")
        wait_end = time.perf_counter()
        timer.add({**runner_output.timings, "schedule": entry.schedule_span[1] - entry.schedule_span[0]})
        _, processed = self._update_and_process(entry.scheduler_output, runner_output, timer)
        overlap = self._overlap(entry, forward, (wait_end - timer.timings["wait"], wait_end))
        self._observe(self._record(entry.scheduler_output, timer, runner_output, processed.stats, overlap))
        if queue and queue.peek().future is None:  # it needed this step's tokens on the host
            queue.submit(queue.peek(), self.scheduler.get_grammar_bitmask(queue.peek().scheduler_output))
        if queue and not self.scheduler.has_unfinished_requests():
            return processed.outputs + self.step_with_batch_queue()
        return processed.outputs

    def _update_and_process(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
                            timer: StageTimer) -> tuple[list[Request], StepOutputs]:
        """After a step's batch ran (either step): update the requests (tokens, connector
        transfers), take the pooled outputs, process the outputs (the pooled ones appended),
        release the siblings whose prompt is now cached (n > 1); timed as "output". Returns the
        requests that got a token and the processed outputs."""
        now = self.clock()
        updated = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, runner_output.failed,
            spec_decode=runner_output.spec_decode, now=now, kv_connector_output=runner_output.kv_connector_output)
        pooled, errors = self.pooling.take_outputs(self.scheduler, runner_output.pooler_output)
        processed = self.output_processor.process(
            updated, logprobs=runner_output.logprobs, prompt_logprobs=runner_output.prompt_logprobs,
            errors=errors, now=now)
        processed.outputs.extend(pooled)
        for sibling in self.output_processor.release_siblings():
            self.scheduler.add_request(sibling)
        timer.lap("output")
        return updated, processed

    def _schedule_ahead(self) -> None:
        """Schedule the next step and queue it; its batch starts at once, unless a request in
        it needs the token still in flight on the host (then after the previous step's update)."""
        start, under = time.perf_counter(), self.batch_queue.in_flight_step
        scheduler_output = self.scheduler.schedule()
        deferred = self.scheduler.pending_output_request_ids(scheduler_output)
        bitmask = None if deferred else self.scheduler.get_grammar_bitmask(scheduler_output)
        self.batch_queue.add(scheduler_output, self.scheduler.requests,
                             (start, time.perf_counter()), under, deferred, bitmask)

    def _overlap(self, entry: InFlight, forward: tuple[float, float] | None = None,
                 wait: tuple[float, float] | None = None) -> StepOverlap:
        """The StepOverlap of a step of the batch queue: its spans as far as known (``wait``:
        the engine thread blocked on its batch; its update runs from then to now)."""
        spans = {"schedule": entry.schedule_span}
        if forward is not None:
            spans.update(forward=forward, wait=wait, update=(wait[1], time.perf_counter()))
        placeholders = tuple(c.request_id for c in entry.scheduler_output.scheduled
                             if c.token_ids and c.token_ids[-1] == PLACEHOLDER_TOKEN_ID)
        return StepOverlap(entry.scheduled_under, placeholders, entry.deferred,
                           self.scheduler.discarded.pop(entry.scheduler_output.step, ()), spans)

    def _propose_drafts(self, updated: list) -> None:
        """Speculative decoding: drafts for the next step from this step's tokens (the
        scheduler keeps a constrained request's grammar-valid prefix)."""
        if self.proposer is not None:
            self.proposer.remove(self.scheduler.finished_request_ids)  # finished in this step
            running = [r for r in updated if r.status is RequestStatus.RUNNING]
            self.scheduler.update_draft_token_ids(self.proposer.propose(running))

    def _record(self, scheduler_output: SchedulerOutput, timer: StageTimer, result=None,
                iteration_stats: IterationStats | None = None, overlap: StepOverlap | None = None) -> StepRecord:
        """The complete record of step ``scheduler_output`` (``result``: the runner's output,
        None when it raised): the step's one SchedulerStats, the requests the scheduler
        finished in it, the block and request events since the previous record (so the
        history replays without gaps), its IterationStats and its timings.

        The timings' stages (TIMING_STAGES) add up to the call up to this record ("record":
        building it); what runs after -- the observers: history, request tracker, tracer, stat
        loggers and ``on_step`` hooks -- lands in the next step's ``driver`` time, with the
        caller's own work between the two steps (kept only when this step left work to do)."""
        scheduler, kv = self.scheduler, self.kv_cache
        kv_stats = scheduler_output.kv_cache_stats + kv.make_stats()  # since the previous record
        self.scheduler_stats = SchedulerStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv_stats.prefix_cache_queries,
            prefix_cache_hits=kv_stats.prefix_cache_hits,
            num_preemptions=len(scheduler_output.preempted_request_ids),
            num_blocks_allocated=kv_stats.num_blocks_allocated,
            num_blocks_freed=kv_stats.num_blocks_freed,
            num_blocks_evicted=kv_stats.num_blocks_evicted,
            **(self._lora_stats() if self.config.enable_lora else {}),
            spec_decoding_stats=SpecDecodingStats.of(result.spec_decode.values()) if result is not None else None,
            **explain_stats(scheduler, scheduler_output),
            kv_connector_stats=KVConnectorStats.of(result.kv_connector_output.transfers)
            if result is not None and result.kv_connector_output is not None else None,
        )
        grammar_step = scheduler.take_grammar_step()
        iteration_stats = iteration_stats or IterationStats()
        iteration_stats.grammar_compile_seconds = list(grammar_step.compile_seconds)
        iteration_stats.num_grammar_cache_hits = len(grammar_step.cache_hits)
        if scheduler.explainer is not None:
            iteration_stats.deferred_times = scheduler.explainer.take_deferred_times()
        events = kv.take_events(), scheduler.take_events()
        timer.lap("record")
        self._step_end = time.perf_counter() if self.has_unfinished_requests() else None
        return StepRecord(
            step=scheduler_output.step,
            scheduler_output=scheduler_output,
            batch=result.batch if result is not None else None,
            sampled_token_ids=result.sampled_token_ids if result is not None else {},
            finished_request_ids=scheduler.finished_request_ids,
            scheduler_stats=self.scheduler_stats,
            timings=timer.timings,
            kv_events=events[0],
            request_events=events[1],
            structured_output=grammar_step,
            spec_decode=result.spec_decode if result is not None else {},
            iteration_stats=iteration_stats,
            kv_connector_output=result.kv_connector_output if result is not None else None,
            overlap=overlap,
        )

    def _observe(self, record: StepRecord) -> None:
        """Hand the complete record to every observer, once, in order: the history, the
        request tracker, the tracer, the stat loggers, then the ``on_step`` hooks (one that
        raises is logged and skipped, never breaking the step)."""
        self.history.append(record, self.kv_cache)
        self.request_tracker.consume(record.request_events)
        if self.tracer is not None:
            self.tracer.consume(record)
        for stat_logger in self.stat_loggers.values():
            stat_logger.record(record.scheduler_stats, record.iteration_stats)
        self._unrecorded_aborts = False  # recorded: history, request tracker, stat loggers
        if self.config.log_stats and time.monotonic() - self._last_log_time >= self.config.log_stats_interval:
            self.do_log_stats()
        for hook in list(self.on_step):
            try:
                hook(record)
            except Exception:
                logger.exception("on_step hook %r failed at step %d", hook, record.step)
        self.idle.mark_busy()

    def _lora_stats(self) -> dict[str, dict[str, int]]:
        """Requests per adapter, running and waiting (vLLM's lora_requests_info labels)."""
        stats: dict[str, dict[str, int]] = {"running_lora_adapters": {}, "waiting_lora_adapters": {}}
        for key, queue in (("running_lora_adapters", self.scheduler.running),
                           ("waiting_lora_adapters", self.scheduler.waiting)):
            for r in queue:
                if r.lora_request is not None:
                    stats[key][r.lora_name] = stats[key].get(r.lora_name, 0) + 1
        return stats

    # ------------------------------------------------------------ research layer
    def fork(self) -> LLMEngine:
        """An independent engine in exactly this one's state (queues, block tables, prefix
        cache, KV tensors, LoRA adapters and slots, sampling generators, detokenizers,
        grammars, history, clock); only the weights' storage is shared, and nothing writes
        it. Left unchanged, both step as a fresh engine given the same inputs would.
        RuntimeError while it sleeps, is being profiled, or is served from another thread
        (see :mod:`workbench.engine.fork`)."""
        if self.batch_queue is not None:  # the KV cache is copied once no batch writes it
            self.batch_queue.wait()
        return fork_engine(self)

    def explain(self, request_id: str, step: int | None = None):
        """Why a request waited, ran short or was preempted, step by step (see
        :meth:`StepHistory.explain <workbench.engine.history.StepHistory.explain>`)."""
        return self.history.explain(request_id, step)

    def requests_dataframe(self):
        """One row per request seen (queue time, TTFT, TPOT, e2e latency in steps and
        seconds, preemptions, recomputed and cached tokens): see
        :class:`~workbench.metrics.request_tracker.RequestTracker`."""
        return self.request_tracker.dataframe()

    # ------------------------------------------------------------------ stat loggers
    def add_logger(self, logger_name: str, logger: StatLoggerBase) -> None:
        """Register a stat logger (vLLM's API); it sees every following step. RuntimeError
        when stat logging is off (``log_stats=False``), KeyError for a name taken (vLLM's)."""
        self._check_log_stats()
        if logger_name in self.stat_loggers:
            raise KeyError(f"Logger with name {logger_name} already exists.")
        self.stat_loggers[logger_name] = logger

    def remove_logger(self, logger_name: str) -> None:
        """Unregister a stat logger; RuntimeError when stat logging is off, KeyError for an
        unknown name (vLLM's)."""
        self._check_log_stats()
        if logger_name not in self.stat_loggers:
            raise KeyError(f"Logger with name {logger_name} does not exist.")
        del self.stat_loggers[logger_name]

    def _check_log_stats(self) -> None:
        if not self.config.log_stats:  # vLLM's rule; its flag is disable_log_stats
            raise RuntimeError("Stat logging is disabled. Set `log_stats=True` (vLLM's "
                               "`disable_log_stats=False`) argument to enable.")

    def do_log_stats(self) -> None:
        """Ask every stat logger to emit (the periodic line logs what it saw since the last)."""
        self._last_log_time = time.monotonic()
        for stat_logger in self.stat_loggers.values():
            stat_logger.log()

    def _repr_html_(self) -> str:
        mc, kv = self.model_config, self.kv_cache
        rows = {
            "model": f"{mc.architecture} ({html.escape(mc.path.name)}), {mc.num_layers} layers",
            "device / attention": f"{self.device.type} / {self.attention_backend}"
                                  + (", batch-invariant" if self.runner.batch_invariant else ""),
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
            f"attention={self.attention_backend}, "
            + ("batch_invariant=True, " if self.runner.batch_invariant else "")
            + f"blocks={self.kv_cache.num_blocks}x"
            f"{self.kv_cache.block_size}, running={len(self.scheduler.running)}, "
            f"waiting={len(self.scheduler.waiting)}, steps={len(self.history)})"
        )
