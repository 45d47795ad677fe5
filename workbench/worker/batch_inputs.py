"""BatchInputs: the packed tensors of one forward pass, and build_batch_inputs, which packs a
SchedulerOutput from scratch (the reference the runner's persistent batch is checked against)."""

from __future__ import annotations

import html
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from workbench.core.sched.output import SchedulerOutput


@dataclass(frozen=True)
class BatchInputs:
    """The tensors one forward pass consumes (built on the CPU; ``to(device)`` for the model).

    ``input_ids``/``positions``/``slot_mapping`` have one entry per scheduled token;
    ``block_tables``/``seq_lens`` one row per scheduled request (``query_start_loc`` one more);
    ``logits_indices`` selects the last token of each request that samples this step, in the
    order of ``sample_request_ids`` -- for a speculating request its last ``k + 1`` tokens
    (the last known token and its ``k`` drafts: the rows the rejection sampler verifies).
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
        """The same batch with every tensor on ``device`` (itself when already there).

        To CUDA, each tensor goes through pinned host memory with a non-blocking copy, so the
        host does not wait for the transfer (this batch's own tensors stay as they are: the
        step's record keeps them)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        pin = device.type == "cuda"
        moved = {
            f.name: (t.pin_memory() if pin else t).to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(t := getattr(self, f.name), torch.Tensor)
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


def build_batch_inputs(
    scheduler_output: SchedulerOutput, block_size: int, table_width: int | None = None
) -> BatchInputs:
    """Pack the scheduled chunks into flat CPU tensors: plain Python lists, one tensor each.

    ``block_tables`` has ``table_width`` columns (padding -1) when given, so that its shape
    does not change from step to step (compiled kernels see one stride); else as many as the
    longest table of the step.
    """
    scheduled = scheduler_output.scheduled
    width = table_width or max(len(s.block_ids) for s in scheduled)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables = np.full((len(scheduled), width), -1, dtype=np.int32)
    query_start_loc = [0]
    logits_indices: list[int] = []
    for i, s in enumerate(scheduled):
        blocks = s.block_ids
        input_ids.extend(s.token_ids)
        span = range(s.num_computed_tokens, s.seq_len)
        positions.extend(span)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        tables[i, :len(blocks)] = blocks
        query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
        if s.samples:
            end = query_start_loc[-1]
            logits_indices.extend(range(end - 1 - len(s.spec_token_ids), end))

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype)

    return BatchInputs(
        request_ids=tuple(s.request_id for s in scheduled),
        sample_request_ids=tuple(s.request_id for s in scheduled if s.samples),
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        block_tables=torch.from_numpy(tables),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor([s.seq_len for s in scheduled], torch.int32),
        logits_indices=tensor(logits_indices, torch.int64),
    )
