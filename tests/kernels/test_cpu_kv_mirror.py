"""The K/V mirror of the cpu backend (kernels/cpu_kv_mirror.py) against the torch reference.

A scripted run of forwards over a small paged cache (block size 4, two layers, the second with
a sliding window) where requests prefill in chunks, decode, verify speculative tokens and roll
back, are preempted and come back in other blocks, finish and have their id reused, see a block
of their table swapped, and where a forward stops after its first layer. Every layer's output
must match ``reference.paged_attention`` over the paged cache (the truth); unwritten slots hold
NaN, so a copy of a slot past a length poisons the result.
"""

from __future__ import annotations

import torch

from workbench import LLM, SamplingParams
from workbench.kernels import cpu_attention, cpu_kv_mirror, reference
from workbench.kernels.cpu_kv_mirror import KVMirror

BLOCK, KV_HEADS, GROUP, HEAD_DIM, NUM_BLOCKS = 4, 2, 2, 8, 96
WINDOWS = (None, 5)  # layer 0: full attention, layer 1: a sliding window


class Sim:
    """Requests over a paged cache; ``step`` runs one forward through the mirror and checks it."""

    def __init__(self, mirror: KVMirror, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
        self.caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                       for _ in WINDOWS]
        self.free = torch.randperm(NUM_BLOCKS - 1, generator=self.gen).add(1).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.mirror = mirror

    def release(self, rid: str) -> None:
        self.free += self.blocks.pop(rid)
        del self.lens[rid]

    def step(self, chunks: list[tuple[str, int]], finished=(), layers: int = len(WINDOWS)):
        """Schedule ``(request id, new tokens)``, write their K/V in every layer, run the
        attention of the first ``layers`` layers."""
        slots, q_lens, seq_lens = [], [], []
        for rid, q in chunks:
            start = self.lens.get(rid, 0)
            table = self.blocks.setdefault(rid, [])
            while len(table) * BLOCK < start + q:
                table.append(self.free.pop())
            self.lens[rid] = start + q
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + q)]
            q_lens.append(q)
            seq_lens.append(start + q)
        width = max(len(self.blocks[rid]) for rid, _ in chunks)
        tables = torch.tensor([self.blocks[rid] + [0] * (width - len(self.blocks[rid]))
                               for rid, _ in chunks], dtype=torch.int32)
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        n = len(slots)
        binding = self.mirror.bind([rid for rid, _ in chunks], set(finished), qsl, lens, tables,
                                   self.caches, BLOCK)
        plan = cpu_attention.plan_attention(tables, qsl, lens, BLOCK, kv_mirror=binding)
        for layer, ((kc, vc), window) in enumerate(zip(self.caches, WINDOWS)):
            k, v, q = (torch.randn(n, heads, HEAD_DIM, generator=self.gen)
                       for heads in (KV_HEADS, KV_HEADS, KV_HEADS * GROUP))
            cpu_attention.write_kv_cache(k, v, kc, vc, torch.tensor(slots))
            if layer >= layers:
                continue
            got = cpu_attention.paged_attention(q, kc, vc, tables, qsl, lens, 0.3,
                                                sliding_window=window, plan=plan)
            want = reference.paged_attention(q, kc, vc, tables, qsl, lens, 0.3,
                                             sliding_window=window)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return binding, plan


def test_mirror_matches_reference_through_a_requests_life():
    sim = Sim(KVMirror())
    binding, _ = sim.step([("a", 7), ("b", 10), ("c", 3)])
    assert binding is None  # nothing decodes: the mirror has no part
    binding, plan = sim.step([("a", 1), ("b", 1), ("c", 1)])
    assert binding.num_filled == 8 + 11 + 4  # first decode: every position copied in
    assert not plan.decode_groups and sum(g.rows.numel() for g in plan.mirror_groups) == 3
    for _ in range(3):  # steady decode: one position per sequence and layer
        binding, _ = sim.step([("a", 1), ("b", 1), ("c", 1)])
        assert binding.num_filled == 3
    # chunked prefill of d beside the decodes, then d decodes
    sim.step([("a", 1), ("d", 5), ("b", 1)])  # c absent: loses its row
    binding, _ = sim.step([("d", 4), ("c", 1), ("a", 1)])  # b absent: loses its row
    assert binding.num_filled == 8 + 1  # c copied in again
    binding, _ = sim.step([("d", 1), ("a", 1), ("b", 1), ("c", 1)])
    assert binding.num_filled == 10 + 1 + 16 + 1  # d and b copied in whole
    # speculative verify of b (3 positions), two rejected, then b decodes over them
    sim.step([("b", 3), ("a", 1)])
    sim.lens["b"] -= 2
    binding, _ = sim.step([("b", 1), ("a", 1)])
    assert binding.num_filled == 2 + 1  # b: the verified first position and the new one
    # a one-token step rolled back (its position written again by the next decode)
    sim.step([("b", 1), ("a", 1)])
    sim.lens["b"] -= 2
    binding, _ = sim.step([("b", 1), ("a", 1)])
    assert binding.num_filled == 1 + 1
    # preemption of c: its blocks go, it comes back recomputed in other blocks
    sim.release("c")
    sim.step([("a", 1), ("b", 1)])
    sim.step([("c", 9), ("a", 1)])
    sim.step([("c", 1), ("a", 1), ("b", 1)])
    # a finishes; a new request reuses its id, sharing b's first (full) block
    sim.release("a")
    sim.blocks["a"], sim.lens["a"] = [sim.blocks["b"][0]], BLOCK
    binding, _ = sim.step([("a", 3), ("b", 1)], finished={"a"})
    sim.step([("a", 1), ("b", 1), ("d", 1), ("c", 1)])
    # a block of d's table replaced by another block (other contents) without a prefill
    new = sim.free.pop()
    for kc, vc in sim.caches:
        for cache in (kc, vc):
            cache[new] = torch.randn(BLOCK, KV_HEADS, HEAD_DIM, generator=sim.gen)
    sim.blocks["d"][1] = new
    binding, _ = sim.step([("d", 1), ("b", 1)])
    assert binding.num_filled == (sim.lens["d"] - BLOCK) + 1


def test_a_forward_that_stops_early_clears_the_mirror():
    sim = Sim(KVMirror())
    sim.step([("a", 6), ("b", 9)])
    sim.step([("a", 1), ("b", 1)])
    sim.step([("a", 1), ("b", 1)], layers=1)  # interrupted after layer 0: layer 1 never filled
    binding, _ = sim.step([("a", 1), ("b", 1)])
    assert binding.num_filled == sim.lens["a"] + sim.lens["b"]  # all copied in again


def test_repacked_rows_and_ragged_lengths(monkeypatch):
    """Rows in an order that pads badly are re-sorted by length, once; results stay exact."""
    monkeypatch.setattr(cpu_attention, "MIN_GROUP_SAVING", 8)
    sim = Sim(KVMirror(), seed=1)
    lens = [3, 40, 5, 37, 2, 44, 6, 30]
    sim.step([(f"r{i}", n) for i, n in enumerate(lens)])
    for _ in range(3):
        _, plan = sim.step([(f"r{i}", 1) for i in range(len(lens))])
    assert sim.mirror.repacks == 1
    by_length = sorted(range(len(lens)), key=lens.__getitem__)
    assert [sim.mirror.row_of[f"r{i}"] for i in by_length] == list(range(len(lens)))
    assert len(plan.mirror_groups) > 1


def test_sequences_past_the_budget_gather():
    """A budget for 128 positions of 32 rows: a longer sequence takes the gathering path."""
    budget = 32 * 128 * KV_HEADS * HEAD_DIM * 4 * 2 * len(WINDOWS)
    sim = Sim(KVMirror(budget_bytes=budget))
    sim.step([("short", 20), ("long", 140)])
    binding, plan = sim.step([("short", 1), ("long", 1)])
    assert binding.seqs == [0] and sum(g.rows.numel() for g in plan.decode_groups) == 1
    assert sim.mirror.nbytes <= budget
    assert KVMirror(budget_bytes=0).bind(["x"], set(), torch.tensor([0, 1], dtype=torch.int32),
                                         torch.tensor([5], dtype=torch.int32),
                                         torch.zeros(1, 2, dtype=torch.int32), sim.caches,
                                         BLOCK) is None


def test_cut_rows_pads_less_than_one_group():
    lens = [10, 200, 12, 11, 190, 9]
    cuts = cpu_kv_mirror.cut_rows(lens, 3, 1)
    assert cpu_kv_mirror.padded(lens, 3, 1) < len(lens) * 200
    assert cuts[-1] == len(lens) and len(cuts) == 3


def test_engine_tokens_same_with_and_without_the_mirror():
    """Greedy tokens with the mirror equal those without, through chunked prefill (a 64-token
    budget), prefix hits (a shared prefix) and preemption (12 blocks)."""
    shared = list(range(40, 80))
    prompts = [{"prompt_token_ids": shared + [5 + i] * (3 + 7 * i)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runs = []
    for mirror in (True, False):
        llm = LLM(max_num_batched_tokens=64, num_kv_blocks=12)
        if not mirror:
            llm.engine.runner.kv_mirror = None
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if mirror:
            records = llm.engine.history
            assert llm.engine.runner.kv_mirror.num_rows > 0
            assert any(r.scheduler_output.preempted_request_ids for r in records)
    assert runs[0] == runs[1]
