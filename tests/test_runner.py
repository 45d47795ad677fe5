"""build_batch_inputs: the packed batch for a hand-built SchedulerOutput, worked out by hand."""

import torch

from workbench.core.scheduler_output import ScheduledRequest, SchedulerOutput
from workbench.runner import build_batch_inputs


def test_packed_batch_of_a_decode_a_chunk_and_a_prefix_hit():
    block_size = 4
    so = SchedulerOutput(
        step=0,
        scheduled=(
            # decode: token 9 at position 5 -> block_ids[1] = 7, offset 1 -> slot 29
            ScheduledRequest("a", 5, 1, (9,), (3, 7), is_prefill=False, samples=True),
            # first prefill chunk of 3 tokens at positions 0..2 of block 2 -> slots 8, 9, 10
            ScheduledRequest("b", 0, 3, (1, 2, 3), (2,), is_prefill=True, samples=False),
            # prefix hit of 4 tokens (block 0), computing positions 4..5 in block 5 -> 20, 21
            ScheduledRequest("c", 4, 2, (4, 5), (0, 5), is_prefill=True, samples=True,
                             num_cached_tokens=4),
        ),
    )
    batch = build_batch_inputs(so, block_size)
    assert batch.to("cpu") is batch
    assert batch.input_ids.tolist() == [9, 1, 2, 3, 4, 5]
    assert batch.positions.tolist() == [5, 0, 1, 2, 4, 5]
    assert batch.slot_mapping.tolist() == [29, 8, 9, 10, 20, 21]
    assert batch.block_tables.tolist() == [[3, 7], [2, -1], [0, 5]]
    assert batch.block_tables.dtype == torch.int32
    assert batch.query_start_loc.tolist() == [0, 1, 4, 6]
    assert batch.seq_lens.tolist() == [6, 3, 6]
    assert batch.logits_indices.tolist() == [0, 5]  # last token of "a" and of "c"
    assert batch.sample_request_ids == ("a", "c")
    assert repr(batch) == (
        "BatchInputs(num_seqs=3, num_tokens=6, query_lens=[1, 3, 2], seq_lens=[6, 3, 6], "
        "sampling=['a', 'c'])"
    )
    assert "<table>" in batch._repr_html_()
