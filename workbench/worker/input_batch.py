"""InputBatch: the runner's persistent batch, one row per scheduled request, kept across steps.

vLLM's ``InputBatch``: each step applies the :class:`SchedulerOutput` as a diff, as vLLM's
``GPUModelRunner._update_states`` does -- rows of finished, preempted and unscheduled requests
are removed (the last row moves into the hole, so the rows stay dense), new and resumed
requests get a row, and a running request's row takes only its new tokens, its new blocks and
its position. Python work per step is proportional to the requests that changed; what every
row needs (positions, slots, the block-table gather, the logits indices) is numpy over the
whole batch, one call each, and the scheduled requests' fields are read with C-level ``map``.

Invariants after :meth:`update` of a step that scheduled requests ``R`` (in any order):

* rows ``0 .. num_reqs - 1`` hold exactly ``R``; ``req_id_to_index`` maps each to its row;
* ``token_ids[i, :num_tokens[i]]`` are row ``i``'s tokens in the KV cache after the step (its
  chunk's tokens included) and ``num_computed_tokens[i]`` is the chunk's first position;
* ``block_table[i, :num_blocks[i]]`` is the request's block table (the chunk's ``block_ids``),
  -1 after it;
* ``temperature``/``top_k``/``top_p``/``min_p`` are the request's sampling parameters (read
  when the row was added: a request's parameters do not change while it runs, vLLM's rule).

:meth:`prepare` returns the same :class:`BatchInputs` as :func:`build_batch_inputs` builds
from scratch (``tests/worker/test_input_batch.py`` checks it after every step of drawn runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, compress
from operator import attrgetter, is_not, not_

import numpy as np
import torch

from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.request import Request
from workbench.worker.batch_inputs import BatchInputs
from workbench.worker.sampler import SamplingMetadata, is_plain_greedy_params

_id = attrgetter("request_id")
_start = attrgetter("num_computed_tokens")
_new = attrgetter("num_new_tokens")
_tokens = attrgetter("token_ids")
_blocks = attrgetter("block_ids")
_samples = attrgetter("samples")
_spec = attrgetter("spec_token_ids")


def _grown(array: np.ndarray, rows: int, cols: int | None = None, fill=0) -> np.ndarray:
    """``array`` with at least ``rows`` rows (and ``cols`` columns), each axis at least
    doubling when it grows; new cells hold ``fill``."""
    shape = list(array.shape)
    if shape[0] < rows:
        shape[0] = max(rows, 2 * shape[0])
    if cols is not None and shape[1] < cols:
        shape[1] = max(cols, 2 * shape[1])
    if shape == list(array.shape):
        return array
    out = np.full(shape, fill, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


class InputBatch:
    """The persistent batch of one runner (see the module docstring for its invariants)."""

    def __init__(self, block_size: int, table_width: int | None = None, *,
                 max_num_reqs: int = 8, max_num_tokens: int = 256) -> None:
        self.block_size = block_size
        #: Fixed block-table width of the prepared batch (compiled kernels), else the step's longest.
        self.table_width = table_width
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self._block_ids: dict[str, tuple[int, ...]] = {}  # the block-id tuple each table holds
        self.token_ids = np.zeros((max_num_reqs, max_num_tokens), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        blocks = max(table_width or 0, -(-max_num_tokens // block_size))
        self.block_table = np.full((max_num_reqs, blocks), -1, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        #: Requests whose parameters need more than one argmax (vLLM keeps such id sets too).
        self._not_plain_greedy: set[str] = set()
        self._min_tokens: dict[str, int] = {}  # plain greedy once this many tokens are out

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __repr__(self) -> str:
        return (f"InputBatch(num_reqs={self.num_reqs}, capacity={self.token_ids.shape[0]}x"
                f"{self.token_ids.shape[1]} tokens, block_size={self.block_size})")

    # ------------------------------------------------------------- rows
    def _ensure(self, rows: int, tokens: int = 0, blocks: int = 0) -> None:
        """Room for ``rows`` rows of ``tokens`` tokens and ``blocks`` blocks."""
        if rows > self.token_ids.shape[0] or tokens > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, rows, tokens)
        if rows > self.block_table.shape[0] or blocks > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, rows, blocks, fill=-1)
        if rows > self.num_tokens.shape[0]:
            for name in ("num_tokens", "num_computed_tokens", "num_blocks", "temperature",
                         "top_k", "top_p", "min_p"):
                setattr(self, name, _grown(getattr(self, name), rows))

    def add_request(self, chunk: ScheduledRequest, request: Request) -> int:
        """A row for a request not in the batch (new, resumed, or not scheduled last step):
        its tokens before the chunk from ``request``, its sampling parameters; the chunk's
        tokens and blocks come with :meth:`update`. Returns the row."""
        row = len(self.req_ids)
        start = chunk.num_computed_tokens
        self._ensure(row + 1, start + chunk.num_new_tokens)
        self.req_ids.append(chunk.request_id)
        self.req_id_to_index[chunk.request_id] = row
        self._block_ids[chunk.request_id] = ()
        self.num_blocks[row] = 0
        self.token_ids[row, :start] = request.token_ids_slice(0, start)
        self.num_tokens[row] = start
        sp = request.sampling_params
        self.temperature[row] = sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        if not is_plain_greedy_params(sp):
            self._not_plain_greedy.add(chunk.request_id)
        elif sp.min_tokens > 0:
            self._min_tokens[chunk.request_id] = sp.min_tokens
        return row

    def remove_request(self, request_id: str) -> None:
        """Drop a request's row; the last row moves into it (condense: rows stay dense)."""
        row = self.req_id_to_index.pop(request_id)
        self._not_plain_greedy.discard(request_id)
        self._min_tokens.pop(request_id, None)
        last = len(self.req_ids) - 1
        self.block_table[row, :self.num_blocks[row]] = -1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_index[moved] = row
            n, b = self.num_tokens[last], self.num_blocks[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.block_table[row, :b] = self.block_table[last, :b]
            self.block_table[last, :b] = -1
            for array in (self.num_tokens, self.num_computed_tokens, self.num_blocks,
                          self.temperature, self.top_k, self.top_p, self.min_p):
                array[row] = array[last]
        self.req_ids.pop()
        del self._block_ids[request_id]

    def _write_blocks(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        """The request's table becomes ``block_ids``: only the new tail when the old table is
        its prefix (a running request's table only grows), else the whole row."""
        row = self.req_id_to_index[request_id]
        old = self._block_ids[request_id]
        k = len(old) if block_ids[:len(old)] == old else 0
        if len(block_ids) > self.block_table.shape[1]:
            self._ensure(0, blocks=len(block_ids))
        table = self.block_table[row]
        table[k:len(block_ids)] = block_ids[k:]
        table[len(block_ids):self.num_blocks[row]] = -1
        self.num_blocks[row] = len(block_ids)
        self._block_ids[request_id] = block_ids

    # ------------------------------------------------------------- the step
    def update(self, scheduler_output: SchedulerOutput,
               requests: Mapping[str, Request]) -> tuple[np.ndarray, ...]:
        """Apply one step's diff (module docstring); return the scheduled requests' rows,
        first positions, new tokens and sequence lengths (int32) after the step, in
        scheduled order."""
        index = self.req_id_to_index
        so = scheduler_output
        for rid in chain(so.finished_request_ids, so.preempted_request_ids):
            if rid in index:
                self.remove_request(rid)
        scheduled = so.scheduled
        ids = list(map(_id, scheduled))
        n = len(ids)
        if n != len(index) or not all(map(index.__contains__, ids)):
            # rows not scheduled this step leave the batch (last row first); new ones come in
            for rid in sorted(set(index).difference(ids), key=index.__getitem__, reverse=True):
                self.remove_request(rid)
            for chunk in compress(scheduled, map(not_, map(index.__contains__, ids))):
                self.add_request(chunk, requests[chunk.request_id])
        rows = np.fromiter(map(index.__getitem__, ids), dtype=np.intp, count=n)
        starts = np.fromiter(map(_start, scheduled), dtype=np.int64, count=n)
        new = np.fromiter(map(_new, scheduled), dtype=np.int64, count=n)
        seq_lens = np.add(starts, new, dtype=np.int32, casting="unsafe")
        held = self._block_ids
        for chunk in compress(scheduled, map(is_not, map(_blocks, scheduled),
                                             map(held.__getitem__, ids))):
            self._write_blocks(chunk.request_id, chunk.block_ids)
        if n and seq_lens.max() > self.token_ids.shape[1]:
            self._ensure(0, int(seq_lens.max()))
        self.num_computed_tokens[rows] = starts
        self.num_tokens[rows] = seq_lens
        return rows, starts, new, seq_lens

    def prepare(self, scheduler_output: SchedulerOutput,
                requests: Mapping[str, Request]) -> BatchInputs:
        """:meth:`update`, then the step's packed inputs, equal to ``build_batch_inputs``'s."""
        rows, starts, new, seq_lens = self.update(scheduler_output, requests)
        scheduled = scheduler_output.scheduled
        n = len(scheduled)
        bs = self.block_size
        input_ids = np.fromiter(chain.from_iterable(map(_tokens, scheduled)), dtype=np.int64)
        num_tokens = len(input_ids)
        if num_tokens == n:  # one token each (no chunk is empty): every decode step
            query_start_loc = np.arange(n + 1, dtype=np.int32)
            token_rows, positions = rows, starts
        else:
            query_start_loc = np.zeros(n + 1, dtype=np.int32)
            new.cumsum(out=query_start_loc[1:])
            token_rows = rows.repeat(new)
            positions = (starts - query_start_loc[:-1]).repeat(new) + np.arange(num_tokens)
        self.token_ids[token_rows, positions] = input_ids
        block_index, offset = np.divmod(positions, bs)
        slots = self.block_table[token_rows, block_index] * np.int64(bs) + offset
        width = self.table_width or max(map(len, map(_blocks, scheduled)))
        tables = self.block_table[rows, :width]
        samples = list(map(_samples, scheduled))
        ends = query_start_loc[1:].astype(np.int64)
        num_drafts = sum(map(len, map(_spec, scheduled)))
        if num_drafts and num_drafts + n == num_tokens and all(samples):
            # every chunk is its last known token and its drafts (no prefill chunk): every
            # token is a row the rejection sampler verifies
            logits_indices = np.arange(num_tokens)
        elif num_drafts:  # a speculating row samples its last k + 1 rows
            counts = np.array(samples, dtype=np.int64) * (
                np.fromiter(map(len, map(_spec, scheduled)), dtype=np.int64, count=n) + 1)
            logits_indices = (np.repeat(ends - counts, counts) + np.arange(int(counts.sum()))
                              - np.repeat(np.cumsum(counts) - counts, counts))
        elif all(samples):
            logits_indices = ends - 1
        else:
            logits_indices = ends[np.array(samples, dtype=bool)] - 1
        ids = tuple(map(_id, scheduled))
        return BatchInputs(
            request_ids=ids,
            sample_request_ids=tuple(compress(ids, samples)),
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens),
            logits_indices=torch.from_numpy(logits_indices),
        )

    def sampling_metadata(self, request_ids: Sequence[str],
                          requests: Mapping[str, Request]) -> SamplingMetadata:
        """The sampling parameters of ``request_ids`` (rows of this step's batch), in that
        order, as tensors; ``all_plain_greedy`` from the batch's id sets (no pass over rows
        unless some row waits for ``min_tokens``)."""
        rows = np.fromiter(map(self.req_id_to_index.__getitem__, request_ids), dtype=np.intp,
                           count=len(request_ids))
        plain = not self._not_plain_greedy and all(
            requests[rid].num_output_tokens >= m for rid, m in self._min_tokens.items())
        return SamplingMetadata(
            all_plain_greedy=plain,
            temperature=torch.from_numpy(self.temperature[rows]),
            top_k=torch.from_numpy(self.top_k[rows]),
            top_p=torch.from_numpy(self.top_p[rows]),
            min_p=torch.from_numpy(self.min_p[rows]),
        )
