"""ModelRunner: turns a SchedulerOutput into a packed batch, runs the model and samples.

The batch is packed: every scheduled token of every request sits in one flat tensor, so
decode (1 token), prefill, chunked prefill and prefix-cache hits are all the same call.
"""

from __future__ import annotations

import html
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

import torch

from workbench.core.scheduler_output import SchedulerOutput
from workbench.model.attention import AttentionMetadata
from workbench.model.llama import allocate_kv_caches
from workbench.model.loader import load_model
from workbench.model.model_config import ModelConfig
from workbench.request import Request
from workbench.sampling import Sampler, TokenLogprobs

logger = logging.getLogger("workbench")


@dataclass(frozen=True)
class BatchInputs:
    """The tensors one forward pass consumes (built on the CPU; ``to(device)`` for the model).

    ``input_ids``/``positions``/``slot_mapping`` have one entry per scheduled token;
    ``block_tables``/``seq_lens`` one row per scheduled request (``query_start_loc`` one more);
    ``logits_indices`` selects the last token of each request that samples this step, in the
    order of ``sample_request_ids``.
    """

    request_ids: tuple[str, ...]
    sample_request_ids: tuple[str, ...]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> BatchInputs:
        """The same batch with every tensor on ``device`` (itself when already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def __repr__(self) -> str:
        return (
            f"BatchInputs(num_seqs={len(self.request_ids)}, num_tokens={self.num_tokens}, "
            f"query_lens={self.query_lens()}, seq_lens={self.seq_lens.tolist()}, "
            f"sampling={list(self.sample_request_ids)})"
        )

    def query_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()

    def _repr_html_(self) -> str:
        rows = []
        starts = self.query_start_loc.tolist()
        for i, rid in enumerate(self.request_ids):
            a, b = starts[i], starts[i + 1]
            rows.append(
                "<tr>"
                f"<td>{html.escape(rid)}</td><td>{b - a}</td><td>{self.seq_lens[i].item()}</td>"
                f"<td>{self.positions[a].item()}..{self.positions[b - 1].item()}</td>"
                f"<td>{self.block_tables[i][self.block_tables[i] >= 0].tolist()}</td>"
                f"<td>{'yes' if rid in self.sample_request_ids else ''}</td></tr>"
            )
        return (
            f"<b>BatchInputs</b>: {len(self.request_ids)} sequences, {self.num_tokens} tokens"
            "<table><tr><th>request</th><th>query len</th><th>seq len</th><th>positions</th>"
            "<th>block table</th><th>samples</th></tr>" + "".join(rows) + "</table>"
        )


def build_batch_inputs(scheduler_output: SchedulerOutput, block_size: int) -> BatchInputs:
    """Pack the scheduled chunks into flat CPU tensors: plain Python lists, one tensor each."""
    scheduled = scheduler_output.scheduled
    width = max(len(s.block_ids) for s in scheduled)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    for s in scheduled:
        blocks = s.block_ids
        input_ids.extend(s.token_ids)
        span = range(s.num_computed_tokens, s.seq_len)
        positions.extend(span)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        tables.append(list(blocks) + [-1] * (width - len(blocks)))
        query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
        if s.samples:
            logits_indices.append(query_start_loc[-1] - 1)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype)

    return BatchInputs(
        request_ids=tuple(s.request_id for s in scheduled),
        sample_request_ids=tuple(s.request_id for s in scheduled if s.samples),
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        block_tables=tensor(tables, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor([s.seq_len for s in scheduled], torch.int32),
        logits_indices=tensor(logits_indices, torch.int64),
    )


@dataclass(frozen=True)
class RunnerOutput:
    """What one execute() produced, by request id: sampled tokens, their logprobs, prompt
    logprobs ``(first prompt index, entries)`` of prefill chunks that asked, and the
    requests whose sampling raised (``failed``: no token, the message); plus the batch
    (None when nothing was scheduled) and timings (s)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    batch: BatchInputs | None = None
    timings: dict[str, float] = field(default_factory=dict)


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Raw logprobs (``log_softmax`` in fp32) of ``targets[i]`` under row ``i``: value, rank
    (1 = most likely) and the ``k`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(targets, device=logits.device).unsqueeze(1)
    values = logprobs.gather(1, chosen)
    ranks = ((logprobs > values).sum(dim=1) + 1).tolist()
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return [
        TokenLogprobs(token_id=t, logprob=v, rank=r, top=tuple(zip(ids, lps)))
        for t, v, r, ids, lps in zip(
            targets, values.squeeze(1).tolist(), ranks, top_ids.tolist(), top_lp.tolist()
        )
    ]


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors and the sampler."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: torch.device,
        block_size: int,
        attention_backend: str,
        load_format: str = "auto",
        seed: int = 0,
    ) -> None:
        self.model_config = model_config
        self.device = device
        self.block_size = block_size
        self.attention_backend = attention_backend
        torch.manual_seed(seed)
        self.model = load_model(model_config, device=device, load_format=load_format, seed=seed)
        self.model.eval()
        self.sampler = Sampler(seed=seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

    def determine_num_blocks(
        self,
        *,
        num_kv_blocks: int | None,
        kv_cache_memory_bytes: int,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
    ) -> int:
        """How many KV blocks to allocate: explicit, or from a memory budget.

        CPU: ``kv_cache_memory_bytes`` // bytes per block. CUDA: after a profiling forward
        pass of ``max_num_batched_tokens`` tokens, the part of
        ``gpu_memory_utilization * total`` that weights and activations leave free.
        """
        per_block = self.model_config.kv_cache_bytes_per_block(self.block_size)
        if num_kv_blocks is not None:
            return num_kv_blocks
        if self.device.type != "cuda":
            budget = kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
        else:
            peak = self._profile_peak_memory(max_num_batched_tokens)
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(total * gpu_memory_utilization) - peak
            source = (
                f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                f"peak after profiling {peak / 2**30:.2f} GiB"
            )
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"No memory left for the KV cache ({source}; one block needs {per_block} bytes). "
                "Raise the budget or pass num_kv_blocks."
            )
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
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
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

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(
            self.model_config, num_blocks, self.block_size, self.device
        )

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> RunnerOutput:
        """Run one step's batch: prepare inputs, forward, sample the requests that need a token.

        First forgets the per-request state (seeded generators) of the requests the
        scheduler finished since the previous step; an empty step does only that.
        """
        for request_id in scheduler_output.finished_request_ids:
            self.sampler.remove(request_id)
        if not scheduler_output.scheduled:
            return RunnerOutput()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        batch = build_batch_inputs(scheduler_output, self.block_size)  # kept on the record
        inputs = batch.to(self.device)
        attn = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            backend=self.attention_backend,
        )
        sync()
        t1 = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sync()
        t2 = time.perf_counter()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        failed: dict[str, str] = {}
        if batch.sample_request_ids:
            rows = [requests[rid] for rid in batch.sample_request_ids]
            out = self.sampler(logits, rows)
            failed = dict(getattr(out, "failed", {}))
            for rid, token, lp in zip(batch.sample_request_ids, out.token_ids, out.logprobs):
                if rid in failed:
                    continue
                sampled[rid] = token
                if lp is not None:
                    logprobs[rid] = lp
        prompt_logprobs = self._prompt_logprobs(scheduler_output, requests, hidden, failed)
        for rid in failed:  # a request failed anywhere gets nothing else from this step
            sampled.pop(rid, None)
            logprobs.pop(rid, None)
        t3 = time.perf_counter()
        timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2}
        return RunnerOutput(sampled, logprobs, prompt_logprobs, failed, batch, timings)

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
                    targets = request.prompt_token_ids[start + 1 : last + 2]
                    out[chunk.request_id] = (start + 1, token_logprobs(logits, targets, k))
                except Exception as exc:  # noqa: BLE001 - isolate this request
                    logger.error("prompt logprobs of request %r failed", chunk.request_id,
                                 exc_info=exc)
                    failed[chunk.request_id] = f"{type(exc).__name__}: {exc}"
            offset += chunk.num_new_tokens
        return out
