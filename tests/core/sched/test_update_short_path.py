"""The update side's decode short path against the general one.

``KVCacheManager.cache_blocks`` extends a partial tail block's tokens by the one token a
decode computed, instead of slicing the tail from the request again. The reference here is
a manager whose tail blocks are emptied before every ``cache_blocks`` call, so it always
slices (the general path). Both drive the same schedule -- a decode crossing block
boundaries, a stop token, verified drafts with some rejected, chunked prefills, a prefix hit
-- and must give the same block events, request events, block hashes and block contents
after every step; each block's tokens are also checked against the request's own.
"""

import pytest

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.output import SpecDecodeResult
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request
from workbench.sampling_params import SamplingParams

BS = 4
STOP = 99


class SlicingKV(KVCacheManager):
    """The general path: no tail block keeps its tokens into the next ``cache_blocks``."""

    def cache_blocks(self, request, num_computed_tokens):
        table = self._tables[request.request_id]
        num_full = num_computed_tokens // self.block_size
        if num_full < len(table) and table[num_full].block_hash is None:
            table[num_full].token_ids = ()
        super().cache_blocks(request, num_computed_tokens)


def token_at(rid: str, position: int) -> int:
    """The fake model's token: request b stops on STOP at its 10th output (position 12)."""
    return STOP if rid == "b" and position == 12 else (7 * position + len(rid)) % 50


def drive(kv_class, drafts_right: bool | None):
    """Run three requests to the end; ``drafts_right``: None (no drafts), or each step's
    drafts are [right, wrong] (True) or [wrong] (False). Returns each step's state."""
    kv = kv_class(64, BS, record_events=True)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=7, max_model_len=64, record_events=True,
                  clock=lambda: 0.0)
    prompts = {"a": list(range(6)), "b": [5, 6, 7], "c": list(range(6)) + [9, 9, 9]}  # c hits a's block
    params = {"a": SamplingParams(max_tokens=11, ignore_eos=True),
              "b": SamplingParams(max_tokens=20, stop_token_ids=[STOP]),
              "c": SamplingParams(max_tokens=9, ignore_eos=True)}
    states = []
    for step in range(200):
        if step in (0, 1):
            for rid in ("ab" if step == 0 else "c"):
                s.add_request(Request(rid, prompts[rid], params[rid], arrival_time=0.0))
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        sampled, results = {}, {}
        for c in out.scheduled:
            if not c.samples:
                continue
            r = s.requests[c.request_id]
            drafts = c.spec_token_ids
            truth = [token_at(c.request_id, r.num_tokens + j) for j in range(len(drafts) + 1)]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
                accepted += 1
            sampled[c.request_id] = truth[accepted]
            if drafts:
                results[c.request_id] = SpecDecodeResult(drafts, accepted)
        got = s.update_from_output(out, sampled, spec_decode=results)
        kv.check_invariants(s.requests.values())  # every block holds its request's own tokens
        if drafts_right is not None:
            s.update_draft_token_ids({
                r.request_id: ([token_at(r.request_id, r.num_tokens), 0] if drafts_right
                               else [token_at(r.request_id, r.num_tokens) + 1])
                for r in got if not r.is_finished})
        states.append((kv.take_events(), s.take_events(),
                       [(b.block_id, b.block_hash, b.token_ids, b.ref_count) for b in kv.blocks],
                       {rid: list(r.block_hashes) for rid, r in s.requests.items()}))
    else:
        raise AssertionError("the requests did not finish")
    return states


@pytest.mark.parametrize("drafts_right", [None, True, False])
def test_the_decode_short_path_gives_the_general_paths_blocks_hashes_and_events(drafts_right):
    short, general = drive(KVCacheManager, drafts_right), drive(SlicingKV, drafts_right)
    assert len(short) == len(general) > 5
    for step, (mine, reference) in enumerate(zip(short, general)):
        assert mine == reference, f"step {step}"
    kv_events = [e for state in short for e in state[0]]
    finished = {e.request_id: (e.reason, e.num_output_tokens) for state in short for e in state[1]
                if type(e).__name__ == "RequestFinished"}
    assert finished == {"a": ("length", 11), "b": ("stop", 10), "c": ("length", 9)}
    names = {type(e).__name__ for e in kv_events}
    assert {"BlockWritten", "BlockStored", "BlockFreed"} <= names
    assert any(type(e).__name__ == "BlockAllocated" and e.prefix_hit for e in kv_events)  # c's hit
