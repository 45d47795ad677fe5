"""ModelRunner: turns a SchedulerOutput into a packed batch, runs the model and samples.

The batch is packed: every scheduled token of every request sits in one flat tensor, so
decode (1 token), prefill, chunked prefill and prefix-cache hits are all the same call. The
runner keeps its requests' rows across steps (:class:`~workbench.worker.input_batch.InputBatch`,
vLLM's persistent batch) and applies each SchedulerOutput to them as a diff.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping

import torch

from workbench.core.sched.output import SchedulerOutput, SpecDecodeResult
from workbench.kernels import batch_invariant
from workbench.model.attention import AttentionMetadata
from workbench.model.llama import allocate_kv_caches
from workbench.model.loader import load_model
from workbench.model.model_config import ModelConfig
from workbench.model.pooler import Pooler
from workbench.request import Request
from workbench.utils.errors import describe
from workbench.utils.ranges import Ranged
from workbench.worker.batch_inputs import BatchInputs, build_batch_inputs  # noqa: F401 (re-exported)
from workbench.worker.input_batch import InputBatch
from workbench.worker.rejection_sampler import RejectionSampler
from workbench.worker.runner_output import RunnerOutput  # noqa: F401 (re-exported)
from workbench.worker.sampler import Sampler, TokenLogprobs, gather_logprobs
from workbench.worker.sleep_mode import SleepMode

logger = logging.getLogger("workbench")


def _stack_spec_masks(row_ids: list[str], drafts: Mapping[str, tuple[int, ...]],
                      masks: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The verifying rows' masks as one [sum(k + 1), words] tensor: a constrained request's
    ``k + 1`` rows (one per verified position), -1 for a free one's; None when none is."""
    if not any(rid in masks for rid in row_ids):
        return None
    words = next(iter(masks.values())).shape[-1]
    return torch.cat([masks[rid].reshape(-1, words) if rid in masks else
                      torch.full((1 + len(drafts[rid]), words), -1, dtype=torch.int32)
                      for rid in row_ids])


def _stack_masks(row_ids: tuple[str, ...], masks: Mapping[str, torch.Tensor]
                 ) -> torch.Tensor | None:
    """The sampling rows' masks as one [rows, words] tensor (-1, all allowed, for free rows);
    None when no row is constrained."""
    if not masks:
        return None
    words = next(iter(masks.values())).shape[-1]
    stacked = torch.full((len(row_ids), words), -1, dtype=torch.int32)
    for row, rid in enumerate(row_ids):
        if rid in masks:
            stacked[row] = masks[rid]
    return stacked


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors and the sampler: the engine's
    :class:`~workbench.worker.runner_protocol.Runner` (the class is its RunnerFactory)."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: torch.device,
        block_size: int,
        attention_backend: str,
        load_format: str = "auto",
        seed: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        self.model_config = model_config
        #: Run forward, logits and sampling in ``kernels.batch_invariant.batch_invariant_mode``:
        #: a request's logits are bitwise the same in any batch, chunking or prefix-cache state.
        self.batch_invariant = batch_invariant
        self.device = device
        self.block_size = block_size
        self.attention_backend = attention_backend
        torch.manual_seed(seed)
        self.model = load_model(model_config, device=device, load_format=load_format, seed=seed)
        self.model.eval()
        self.sampler = Sampler(seed=seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.pooler = Pooler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        #: Compiled (Triton) kernels get block tables of one fixed width, the model length in
        #: blocks, so that no step brings a new shape to compile for.
        self.table_width = (
            -(-model_config.max_model_len // block_size) if attention_backend == "triton" else None
        )
        #: The persistent batch: one row per request the last step scheduled.
        self.input_batch = InputBatch(block_size, self.table_width)
        #: On CUDA the host does not wait for the device except for the sampled tokens; so the
        #: "forward" timing is launch time and the wait shows in "sample". True: synchronise
        #: around the forward so that each timing is the device's (one more sync per step).
        self.sync_timings = False
        #: Multi-LoRA (``enable_lora``): None until :meth:`enable_lora`.
        self.lora_manager = None
        self.load_format, self.seed = load_format, seed  # what sleep level 2 reloads
        #: The :class:`~workbench.worker.sleep_mode.SleepMode` once it first slept, else None.
        self.sleep_mode: SleepMode | None = None

    def determine_num_blocks(
        self,
        *,
        num_kv_blocks: int | None,
        kv_cache_memory_bytes: int,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
        max_num_kv_blocks: int = 2**18,
    ) -> int:
        """How many KV blocks to allocate: explicit, or from a memory budget (at most
        ``max_num_kv_blocks``: every block is also a Python object in the block pool).

        CPU: ``kv_cache_memory_bytes`` // bytes per block. CUDA: after a profiling forward
        pass of ``max_num_batched_tokens`` tokens, the part of
        ``gpu_memory_utilization * total`` that weights and activations leave free, and no
        more than the device has free now (other processes may hold memory).
        """
        per_block = self.model_config.kv_cache_bytes_per_block(self.block_size)
        if num_kv_blocks is not None:
            return num_kv_blocks
        if self.device.type != "cuda":
            budget = kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
        else:
            peak = self._profile_peak_memory(max_num_batched_tokens)
            free, total = torch.cuda.mem_get_info(self.device)
            in_use = torch.cuda.memory_allocated(self.device)
            budget = min(int(total * gpu_memory_utilization) - peak,
                         free + torch.cuda.memory_reserved(self.device) - in_use
                         - int(total * (1 - gpu_memory_utilization)))
            source = (
                f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                f"peak after profiling {peak / 2**30:.2f} GiB, free {free / 2**30:.1f} GiB"
            )
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"No memory left for the KV cache ({source}; one block needs {per_block} bytes). "
                "Raise the budget or pass num_kv_blocks."
            )
        if num_blocks > max_num_kv_blocks:
            source += f"; capped by max_num_kv_blocks={max_num_kv_blocks} from {num_blocks}"
            num_blocks = max_num_kv_blocks
        logger.info("KV cache: %d blocks of %d tokens (%s)", num_blocks, self.block_size, source)
        return num_blocks

    @torch.inference_mode()
    def _profile_peak_memory(self, num_tokens: int) -> int:
        """Run one forward over ``num_tokens`` tokens with a throwaway cache; return peak bytes."""
        num_tokens = min(num_tokens, self.model_config.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        caches = allocate_kv_caches(self.model_config, blocks, self.block_size, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        attn = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=self._pad_table(torch.arange(blocks, dtype=torch.int32, device=self.device)[None]),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            backend=self.attention_backend,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), caches, attn)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    def fork_shared(self) -> list:
        """What an engine's fork shares with this runner (:mod:`workbench.engine.fork`): the
        model config and the weights -- the model's parameters and buffers, which no step
        writes (LoRA slots are not among them: see :mod:`workbench.lora.layers`), and the
        LoRA adapters read into host memory. The rest (the KV cache, the sampler, the modules
        themselves, the LoRA slots and their manager) is each engine's own."""
        adapters = self.lora_manager.fork_shared() if self.lora_manager is not None else []
        return [self.model_config, *self.model.parameters(), *self.model.buffers(), *adapters]

    # ------------------------------------------------------------------ LoRA
    def enable_lora(self, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        """Wrap the model's projections for batched multi-LoRA (before the first step)."""
        from workbench.lora.worker_manager import WorkerLoRAManager

        self.lora_manager = WorkerLoRAManager(
            self.model, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, backend=self.attention_backend)

    def _lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled: create the engine with enable_lora=True "
                             "(--enable-lora).")
        return self.lora_manager

    def add_lora(self, lora_request) -> bool:
        """Load an adapter into host memory (ValueError naming the file if it is bad)."""
        return self._lora().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove_adapter(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self._lora().list_adapters()

    # ------------------------------------------------------------------ logits processors, sleep, profiling
    def set_logits_processors(self, processors) -> None:
        self.sampler.logits_processors = processors

    def sleep(self, level: int) -> int:
        """See :class:`~workbench.worker.sleep_mode.SleepMode` (made on the first sleep)."""
        if self.sleep_mode is None:
            self.sleep_mode = SleepMode(self, load_format=self.load_format, seed=self.seed)
        return self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        if self.sleep_mode is not None:
            self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.is_sleeping

    @contextlib.contextmanager
    def profile_ranges(self):
        """The sampler's calls and the model's forward as ``record_function`` ranges."""
        sampler, ranges = self.sampler, []

        def enter(module, args):
            ranges.append(torch.profiler.record_function("forward"))
            ranges[-1].__enter__()

        def leave(module, args, output):
            ranges.pop().__exit__(None, None, None)

        hooks = [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave)]
        self.sampler = Ranged(sampler, "sample")
        try:
            yield
        finally:
            self.sampler = sampler
            for hook in hooks:
                hook.remove()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(
            self.model_config, num_blocks, self.block_size, self.device
        )

    def _pad_table(self, table: torch.Tensor) -> torch.Tensor:
        """``table`` widened with -1 columns to ``table_width`` (unchanged without one)."""
        if self.table_width is None or table.shape[1] >= self.table_width:
            return table
        return torch.nn.functional.pad(table, (0, self.table_width - table.shape[1]), value=-1)

    @torch.inference_mode()
    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Run the shapes of batch a serving run meets (decode of one and of many sequences, a
        short and a long prefill, a mixed batch) once, so that compiled kernels are compiled
        before the first request and never in the middle of a run. Writes no KV slot (slot -1);
        reads block 0 only. Call it before any request holds blocks."""
        if self.batch_invariant and not batch_invariant.enabled():  # compile the invariant variants
            with batch_invariant.batch_invariant_mode():
                return self.warm_up(max_num_seqs, max_num_batched_tokens)
        max_len = self.model_config.max_model_len
        n_decode = max(1, min(max_num_seqs, max_num_batched_tokens))
        long_prefill = min(max_num_batched_tokens, max_len, 256)
        shapes = [  # (query lengths, context lengths)
            ([1], [min(max_len - 1, 4096)]),  # one long decode: split-KV on a GPU
            ([1] * n_decode, [1] * n_decode),
            ([min(16, max_len)], [0]),
            ([long_prefill], [0]),
            ([min(8, max_len - 1), 1], [1, 1]),
        ]
        for q_lens, ctx_lens in shapes:
            seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
            num_tokens = sum(q_lens)
            table = torch.zeros((len(q_lens), -(-max(seq_lens) // self.block_size)), dtype=torch.int32)
            qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            attn = AttentionMetadata(
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                block_tables=self._pad_table(table).to(self.device),
                query_start_loc=qsl.to(self.device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                backend=self.attention_backend,
            )
            positions = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)])
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            hidden = self.model(ids, positions.to(self.device), self.kv_caches, attn)
            self.model.compute_logits(hidden[qsl[1:].long().to(self.device) - 1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
        grammar_bitmask: Mapping[str, torch.Tensor] | None = None,
    ) -> RunnerOutput:
        """Run one step's batch: prepare inputs, forward, sample the requests that need a token
        (``grammar_bitmask``: the packed mask row of each constrained one).

        First forgets the per-request state (seeded generators) of the requests the
        scheduler finished since the previous step; an empty step does only that.
        ``timings`` add up to the whole call: ``prepare`` is all of it outside ``forward``
        and ``sample`` (inputs, forgetting finished requests, entering inference mode).
        """
        start = time.perf_counter()
        out = self._execute(scheduler_output, requests, grammar_bitmask or {})
        t = out.timings
        t["prepare"] = time.perf_counter() - start - t.get("forward", 0.0) - t.get("sample", 0.0)
        return out

    @torch.inference_mode()
    def _execute(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
        grammar_bitmask: Mapping[str, torch.Tensor],
    ) -> RunnerOutput:
        if self.batch_invariant and not batch_invariant.enabled():
            with batch_invariant.batch_invariant_mode():
                return self._execute(scheduler_output, requests, grammar_bitmask)
        for request_id in scheduler_output.finished_request_ids:
            self.sampler.remove(request_id)
        self.pooler.remove(scheduler_output.finished_request_ids)
        if not scheduler_output.scheduled:
            self.input_batch.update(scheduler_output, requests)  # every row leaves
            return RunnerOutput()
        sync = (
            torch.cuda.synchronize
            if self.device.type == "cuda" and self.sync_timings
            else (lambda: None)
        )
        batch = self.input_batch.prepare(scheduler_output, requests)  # kept on the record
        inputs = batch.to(self.device)
        attn = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            backend=self.attention_backend,
        )
        if self.lora_manager is not None:
            self.lora_manager.set_active_adapters(
                [requests[s.request_id].lora_request for s in scheduler_output.scheduled],
                [s.num_new_tokens for s in scheduler_output.scheduled], self.device)
        sync()
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sync()
        t2 = time.perf_counter()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | list[TokenLogprobs]] = {}
        failed: dict[str, str] = {}
        spec_decode: dict[str, SpecDecodeResult] = {}
        drafts = scheduler_output.scheduled_spec_decode_tokens
        pooling_ids = {c.request_id for c in scheduler_output.scheduled
                       if requests[c.request_id].pooling_params is not None}
        pooler_output = {}
        if pooling_ids:  # pooled instead of sampled
            pooler_output, pool_failed = self.pooler(scheduler_output, requests, hidden)
            failed.update(pool_failed)
        if batch.sample_request_ids:
            plain_ids = batch.sample_request_ids
            plain_logits = logits
            if drafts and len(drafts) == len(batch.sample_request_ids):  # every row verifies
                plain_ids, spec_rows = (), range(logits.shape[0])
            elif drafts:
                plain_ids = tuple(rid for rid in batch.sample_request_ids if rid not in drafts)
                plain_rows, spec_rows, row = [], [], 0
                for rid in batch.sample_request_ids:
                    n = 1 + len(drafts.get(rid, ()))
                    (spec_rows if rid in drafts else plain_rows).extend(range(row, row + n))
                    row += n
                plain_logits = logits[plain_rows] if plain_rows else logits[:0]
            if pooling_ids:
                keep = [i for i, rid in enumerate(plain_ids) if rid not in pooling_ids]
                plain_ids, plain_logits = tuple(plain_ids[i] for i in keep), plain_logits[keep]
            if plain_ids:
                out = self.sampler(plain_logits, list(map(requests.__getitem__, plain_ids)),
                                   _stack_masks(plain_ids, grammar_bitmask),
                                   self.input_batch.sampling_metadata(plain_ids, requests))
                failed.update(out.failed)
                for rid, token, lp in zip(plain_ids, out.token_ids, out.logprobs):
                    if rid in failed:
                        continue
                    sampled[rid] = token
                    if lp is not None:
                        logprobs[rid] = lp
            if drafts:
                spec_ids = [rid for rid in batch.sample_request_ids if rid in drafts]
                spec_logits = logits if len(spec_rows) == logits.shape[0] else logits[spec_rows]
                rej = self.rejection_sampler(spec_logits, [requests[rid] for rid in spec_ids],
                                             [drafts[rid] for rid in spec_ids],
                                             grammar_bitmask=_stack_spec_masks(
                                                 spec_ids, drafts, grammar_bitmask))
                failed.update(rej.failed)
                for rid, tokens, lps, n in zip(spec_ids, rej.token_ids, rej.logprobs, rej.num_accepted):
                    if rid in failed:
                        continue
                    sampled[rid] = tokens[-1]
                    spec_decode[rid] = SpecDecodeResult(drafts[rid], n)
                    if lps is not None:
                        logprobs[rid] = lps
        prompt_logprobs = self._prompt_logprobs(scheduler_output, requests, hidden, failed)
        for rid in failed:  # a request failed anywhere gets nothing else from this step
            sampled.pop(rid, None)
            logprobs.pop(rid, None)
            spec_decode.pop(rid, None)
        t3 = time.perf_counter()
        timings = {"forward": t2 - t1, "sample": t3 - t2}
        return RunnerOutput(sampled, logprobs, prompt_logprobs, failed, batch, timings, spec_decode,
                            pooler_output)

    def _prompt_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        hidden: torch.Tensor,
        failed: dict[str, str],
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens each chunk predicts, for requests that asked:
        the chunk's position ``p`` predicts prompt token ``p + 1``. A request whose
        computation raises goes into ``failed`` ("ExcType: message") instead."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        offset = 0
        for chunk in scheduler_output.scheduled:
            request = requests[chunk.request_id]
            k = request.sampling_params.prompt_logprobs
            # Positions start..last predict prompt tokens start+1..last+1.
            start = chunk.num_computed_tokens
            last = min(chunk.seq_len, request.num_prompt_tokens - 1) - 1
            if k is not None and last >= start and chunk.request_id not in failed:
                try:
                    logits = self.model.compute_logits(hidden[offset : offset + last + 1 - start])
                    targets = torch.tensor(request.prompt_token_ids[start + 1 : last + 2],
                                           device=logits.device)
                    out[chunk.request_id] = (start + 1, gather_logprobs(logits, targets,
                                                                        [k] * len(targets)))
                except Exception as exc:  # noqa: BLE001 - isolate this request
                    logger.error("prompt logprobs of request %r failed", chunk.request_id,
                                 exc_info=exc)
                    failed[chunk.request_id] = describe(exc)
            offset += chunk.num_new_tokens
        return out
