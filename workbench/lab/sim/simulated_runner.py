"""SimulatedRunner: a :class:`~workbench.worker.runner_protocol.Runner` with no model: time is predicted, tokens are fillers.

The engine builds it in place of the ModelRunner (``LLMEngine(make_runner=SimulatedRunner.factory(...))``),
so the real Scheduler and KVCacheManager run unchanged. Each ``execute`` advances the simulated clock
by the CostModel's duration for the batch and gives every sampling request one token:

* a *filler* that can never end it by accident: not its eos, not one of its
  ``stop_token_ids``, within ``allowed_token_ids`` when given, and (with a tokenizer bound)
  sharing no character with its stop strings;
* its eos (or first stop token id) when the request reaches its drawn output length
  (``output_lengths``, for requests that do not ignore eos).

A request with ``ignore_eos`` runs to ``max_tokens`` (the scheduler's length cap).

Speculative decoding (``spec_profile``, set by :func:`~workbench.lab.sim.simulate`): a chunk
that verifies drafts accepts a prefix of them drawn from the profile's per-position rates
(:mod:`workbench.lab.sim.spec_decode`), and its own token comes after the accepted ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from workbench.core.sched.output import SchedulerOutput, SpecDecodeResult
from workbench.lab.sim.clock import SimClock
from workbench.lab.sim.cost_model import CostModel
from workbench.lab.sim.features import PREFILL_STEP, step_features
from workbench.lab.sim.lora_slots import LoRASlots
from workbench.model.model_config import ModelConfig
from workbench.request import Request
from workbench.worker.runner_output import RunnerOutput
from workbench.worker.runner_protocol import RunnerFactory

if TYPE_CHECKING:
    from workbench.worker.device import SimulatedDevice


class SimulatedRunner:
    """Predicts each step's duration with ``cost_model`` on ``clock``; holds no weights and
    no KV tensors (pool sizing is the ModelRunner's, from the model's config.json shapes)."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        block_size: int,
        cost_model: CostModel,
        clock: SimClock,
        batch_invariant: bool = False,
        output_lengths: Mapping[str, int] | None = None,
    ) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.cost_model = cost_model
        #: Nothing to compute, so nothing to keep invariant: a cost model calibrated on an
        #: engine with ``batch_invariant=True`` prices that mode.
        self.batch_invariant = batch_invariant
        self.clock = clock
        #: Output length per request id (children ``"{i}_{id}"`` of ``n > 1`` use their parent's).
        self.output_lengths = dict(output_lengths or {})
        #: Set to the engine's tokenizer so that fillers avoid stop strings' characters.
        self.tokenizer = None
        #: Measured acceptance (a SpecDecodeProfile) for speculative decoding, and the
        #: generator its draws come from (None: no speculation simulated).
        self.spec_profile = None
        self.spec_rng = None
        self.num_blocks = 0
        self.lora_slots: LoRASlots | None = None  # with enable_lora
        self.previous_ran_prefill = False  # the cost model's after_prefill for the next step
        self._fillers: dict[tuple, int] = {}  # (eos, stop ids, stop strings, allowed) -> filler
        # request id -> (request, output length at which its eos comes, filler): read at every
        # token; an entry goes when a step reports its request finished
        self._token_plan: dict[str, tuple[Request, int | None, int]] = {}

    @classmethod
    def factory(cls, cost_model: CostModel, clock: SimClock,
                output_lengths: Mapping[str, int] | None = None) -> RunnerFactory:
        """What ``LLMEngine(make_runner=...)`` takes: builds a SimulatedRunner from the engine's
        runner arguments (picklable). Its ``simulated_device`` is the device the cost model was
        calibrated on (see :mod:`workbench.worker.device`: the engine imports no torch)."""
        make = functools.partial(_build, cls, cost_model=cost_model, clock=clock, output_lengths=output_lengths)
        make.simulated_device = str(cost_model.hardware.get("device") or "cpu")
        return make

    # ------------------------------------------------------------ the Runner interface
    def determine_num_blocks(self, *, num_kv_blocks: int | None, kv_cache_memory_bytes: int,
                             gpu_memory_utilization: float, max_num_batched_tokens: int,
                             max_num_kv_blocks: int = 2**18) -> int:
        """``num_kv_blocks``, else ``kv_cache_memory_bytes`` // bytes per block of this model
        (as on CPU; a simulated GPU has no memory to profile: give either), at most
        ``max_num_kv_blocks``."""
        if num_kv_blocks is not None:
            return num_kv_blocks
        per_block = self.model_config.kv_cache_bytes_per_block(self.block_size)
        num_blocks = kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no KV block "
                             f"({per_block} bytes each); raise it or pass num_kv_blocks.")
        return min(num_blocks, max_num_kv_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks  # no tensors: nothing is computed

    # LoRA: adapters are names, no weights; LoRASlots models the device slots, so a step pays
    # the cost model's lora_loads for each adapter it copies into a slot.
    def enable_lora(self, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.loras: dict[int, str] = {}  # lora_int_id -> lora_name
        self.lora_slots = LoRASlots(max_loras)

    def add_lora(self, lora_request) -> bool:
        added = lora_request.lora_int_id not in self.loras
        self.loras[lora_request.lora_int_id] = lora_request.lora_name
        return added

    def remove_lora(self, lora_id: int) -> bool:
        name = self.loras.pop(lora_id, None)
        if name is not None:
            self.lora_slots.discard(name)
        return name is not None

    def pin_lora(self, lora_id: int) -> bool:
        if lora_id not in self.loras:
            return False
        self.lora_slots.pin(self.loras[lora_id])
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Nothing to compile."""

    def set_logits_processors(self, processors) -> None:
        raise ValueError("logits_processors need a runner that samples (ModelRunner); the "
                         "simulated runner draws filler tokens.")

    def sleep(self, level: int) -> int:
        raise ValueError("sleep mode needs a runner with a model and a KV cache, not SimulatedRunner.")

    def wake_up(self, tags: list[str] | None) -> None:
        """Nothing sleeps."""

    def is_sleeping(self) -> bool:
        return False

    def profile_ranges(self) -> contextlib.AbstractContextManager:
        """No forward or sampler of its own: its predicted time is the execute range."""
        return contextlib.nullcontext()

    def fork_shared(self) -> list:
        """Nothing heavy: a fork copies it whole."""
        return []

    def execute(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                grammar_bitmask=None) -> RunnerOutput:
        """Advance the clock by the predicted duration, plus the wake-up cost for the first
        batch after idle and the input processing of the text prompts that arrived since the
        last step; one token per sampling request (``grammar_bitmask`` is not read: filler
        tokens follow no grammar, so a constrained request ends with an error here)."""
        after_prefill, self.previous_ran_prefill = self.previous_ran_prefill, False
        for rid in scheduler_output.finished_request_ids:
            self._token_plan.pop(rid, None)
        if not scheduler_output.scheduled:
            seconds = self.cost_model.empty_step_s
            self.clock.advance(seconds)
            return RunnerOutput(timings={"simulated": seconds})
        model, clock = self.cost_model, self.clock
        slots = self.lora_slots
        loads = slots.activate(scheduler_output.lora_names) if slots is not None else 0
        features = step_features(scheduler_output, loads, after_prefill)
        self.previous_ran_prefill = features[PREFILL_STEP] > 0
        seconds = model.predict(features)
        if clock.idle_s:  # the first batch after the engine sat idle
            seconds += model.wake_s
            clock.idle_s = 0.0
        if clock.text_prompt_tokens:  # the driver tokenized these prompts before this step
            seconds += model.input_cost(clock.text_prompt_tokens)
            clock.text_prompt_tokens = []
        clock.advance(seconds)
        sampled, spec = {}, {}
        next_token, profile = self._next_token, self.spec_profile
        for s in scheduler_output.scheduled:
            if not s.samples:
                continue
            rid = s.request_id
            if s.spec_token_ids and profile is not None:
                accepted = profile.draw_accepted(len(s.spec_token_ids), self.spec_rng)
                spec[rid] = SpecDecodeResult(s.spec_token_ids, accepted)
                sampled[rid] = next_token(requests[rid], accepted)
            else:
                sampled[rid] = next_token(requests[rid])
        return RunnerOutput(sampled_token_ids=sampled, timings={"forward": seconds, "simulated": seconds},
                            spec_decode=spec)

    # ------------------------------------------------------------ tokens
    def output_length(self, request: Request) -> int | None:
        """The request's drawn output length (None: it has none, it runs to max_tokens)."""
        if request.sampling_params.ignore_eos:
            return None
        rid = request.request_id
        target = self.output_lengths.get(rid)
        if target is None and "_" in rid:
            target = self.output_lengths.get(rid.split("_", 1)[1])
        return target

    def _next_token(self, request: Request, num_accepted: int = 0) -> int:
        """Its eos at its drawn length (after ``num_accepted`` accepted drafts), else its filler."""
        plan = self._token_plan.get(request.request_id)
        if plan is None or plan[0] is not request:
            target = self.output_length(request)
            end = None if target is None else max(target, request.sampling_params.min_tokens)
            plan = self._token_plan[request.request_id] = (request, end, self.filler(request))
        end = plan[1]
        if end is not None and len(request.output_token_ids) + num_accepted + 1 >= end:
            eos = request.eos_token_id
            return eos if eos is not None else request.sampling_params.stop_token_ids[0]
        return plan[2]

    def filler(self, request: Request) -> int:
        """A token that cannot end the request (see the module docstring)."""
        params = request.sampling_params
        key = (request.eos_token_id, tuple(params.stop_token_ids), params.stop_strings,
               tuple(params.allowed_token_ids or ()))
        token = self._fillers.get(key)
        if token is None:
            token = self._fillers[key] = self._filler(*key)
        return token

    def _filler(self, eos: int | None, stop_ids: tuple[int, ...], stops: tuple[str, ...],
                allowed: tuple[int, ...]) -> int:
        banned = set(stop_ids) | {eos}
        stop_chars = set("".join(stops))
        for token in allowed or range(self.model_config.vocab_size - 1, -1, -1):
            if token in banned:
                continue
            if stop_chars and self.tokenizer is not None:
                text = self.tokenizer.decode([token])
                if not text or not stop_chars.isdisjoint(text):
                    continue
            return token
        raise ValueError("no token can be simulated: every allowed token is a stop token or "
                         "contains a character of a stop string.")

    def __repr__(self) -> str:
        return (f"SimulatedRunner(model={self.model_config.path.name}, blocks={self.num_blocks}x"
                f"{self.block_size}, clock={self.clock.now:.6f})")

    def _repr_html_(self) -> str:
        return (f"<b>SimulatedRunner</b>: {self.model_config.path.name}, {self.num_blocks} blocks x "
                f"{self.block_size}, simulated time {self.clock.now:.6f} s")


def _build(cls: type[SimulatedRunner], model_config: ModelConfig, *, device: SimulatedDevice, block_size: int,
           attention_backend: str, load_format: str, seed: int, batch_invariant: bool, cost_model: CostModel,
           clock: SimClock, output_lengths: Mapping[str, int] | None) -> SimulatedRunner:
    """A :class:`~workbench.worker.runner_protocol.RunnerFactory`: the device, the attention
    kernels, the weights and the sampling seed have nothing to simulate."""
    del device, attention_backend, load_format, seed
    return cls(model_config, block_size=block_size, batch_invariant=batch_invariant, cost_model=cost_model,
               clock=clock, output_lengths=output_lengths)
