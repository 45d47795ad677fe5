"""build_batch_inputs: the packed batch for a hand-built SchedulerOutput, worked out by hand."""

import torch

from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.worker.model_runner import build_batch_inputs


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


def test_fixed_width_block_tables_pad_with_minus_one():
    """Compiled kernels get one table width every step (no recompiles): the model length in blocks."""
    so = SchedulerOutput(step=0, scheduled=(
        ScheduledRequest("a", 5, 1, (9,), (3, 7), is_prefill=False, samples=True),))
    batch = build_batch_inputs(so, 4, table_width=5)
    assert batch.block_tables.tolist() == [[3, 7, -1, -1, -1]]
    assert batch.block_tables.dtype == torch.int32


def _runner(backend="cpu"):
    from workbench import default_model_path
    from workbench.model.model_config import ModelConfig
    from workbench.worker.model_runner import ModelRunner

    config = ModelConfig.from_pretrained(default_model_path(), dtype="float32", device=torch.device("cpu"))
    return ModelRunner(config, device=torch.device("cpu"), block_size=16, attention_backend=backend)


def test_kv_blocks_from_memory_are_capped():
    runner = _runner()
    per_block = runner.model_config.kv_cache_bytes_per_block(16)
    kw = dict(num_kv_blocks=None, gpu_memory_utilization=0.9, max_num_batched_tokens=512)
    assert runner.determine_num_blocks(kv_cache_memory_bytes=100 * per_block, **kw) == 100
    assert runner.determine_num_blocks(kv_cache_memory_bytes=100 * per_block, max_num_kv_blocks=30,
                                       **kw) == 30
    # an explicit number is what the user asked for: not capped
    assert runner.determine_num_blocks(**{**kw, "num_kv_blocks": 50}, kv_cache_memory_bytes=0,
                                       max_num_kv_blocks=30) == 50


def test_warm_up_runs_every_shape_and_writes_no_slot():
    runner = _runner("torch")
    runner.allocate_kv_cache(80)
    for k, v in runner.kv_caches:
        k.fill_(0.5)
        v.fill_(0.5)
    runner.warm_up(max_num_seqs=8, max_num_batched_tokens=64)
    assert all(bool((k == 0.5).all() and (v == 0.5).all()) for k, v in runner.kv_caches)


def test_table_width_is_fixed_only_for_compiled_kernels():
    assert _runner("cpu").table_width is None
    triton = _runner("triton")
    assert triton.table_width == -(-triton.model_config.max_model_len // 16)
    assert triton._pad_table(torch.tensor([[4, 2]], dtype=torch.int32)).shape == (1, triton.table_width)


def test_device_defaults_follow_vllm_on_cuda():
    from workbench.config import EngineConfig, default_max_num_batched_tokens, default_max_num_seqs

    assert (default_max_num_seqs("cuda"), default_max_num_seqs("cpu")) == (256, 128)
    assert default_max_num_batched_tokens("cuda", True, 40960) == 8192
    assert default_max_num_batched_tokens("cuda", False, 40960) == 40960
    assert default_max_num_batched_tokens("cpu", True, 1024) == 2048
    assert default_max_num_batched_tokens("cpu", False, 1024) == 2048
    import pytest

    with pytest.raises(ValueError, match="max_num_kv_blocks"):
        EngineConfig(max_num_kv_blocks=0)
