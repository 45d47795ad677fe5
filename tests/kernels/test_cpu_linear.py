"""The CPU linear paths: oneDNN on a packed copy for several rows and the few-rows kernel equal
``F.linear``, the copy follows its weight, each choice is its probe's (or the environment's),
and a model forced onto any path generates the same greedy tokens, with and without
speculation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.kernels import batch_invariant, cpu_few_rows, cpu_linear


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "onednn")


def _weight(out_features=1024, in_features=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen).t().contiguous().t()  # input-major


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_linear_equals_f_linear_at_every_row_count(onednn, rows):
    weight, bias = _weight(), torch.randn(1024)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1))
    packed = cpu_linear.PackedWeight()
    for b in (None, bias):
        torch.testing.assert_close(cpu_linear.linear(x, weight, b, packed), F.linear(x, weight, b))
    assert (packed.nbytes > 0) == (rows >= cpu_linear.MIN_ROWS)  # 1-2 rows never pack


def test_the_copy_follows_its_weight(onednn):
    weight, x = _weight(), torch.randn(5, 192)
    packed = cpu_linear.PackedWeight()
    cpu_linear.linear(x, weight, None, packed)
    with torch.no_grad():
        weight.mul_(2)  # an in-place edit bumps the version
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed), F.linear(x, weight))
    weight.data = _weight(seed=7)  # new storage, as a reload or wake-up gives
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed), F.linear(x, weight))
    packed.release()
    assert packed.nbytes == 0
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed), F.linear(x, weight))


def test_a_deep_copy_shares_the_packed_tensor_and_releases_on_its_own(onednn):
    """What an engine fork does to the model's modules (workbench/engine/fork.py)."""
    import copy

    weight, x = _weight(), torch.randn(5, 192)
    packed = cpu_linear.PackedWeight()
    cpu_linear.linear(x, weight, None, packed)
    twin = copy.deepcopy(packed)
    assert twin.of(weight) is packed.of(weight)
    twin.release()
    assert twin.nbytes == 0 and packed.nbytes > 0
    torch.testing.assert_close(cpu_linear.linear(x, weight, None, twin), F.linear(x, weight))


def test_the_batch_invariant_mode_keeps_its_own_products(onednn):
    weight, x = _weight(), torch.randn(5, 192)
    packed = cpu_linear.PackedWeight()
    with batch_invariant.batch_invariant_mode():
        cpu_linear.linear(x, weight, None, packed)
    assert packed.nbytes == 0


def test_auto_takes_onednn_only_past_the_margin(monkeypatch):
    monkeypatch.delenv("WORKBENCH_CPU_GEMM", raising=False)
    for torch_s, onednn_s, expected in ((3.0, 1.0, True), (1.4, 1.0, False), (1.0, 2.0, False)):
        cpu_linear._decide_onednn.cache_clear()
        monkeypatch.setattr(cpu_linear, "probe", lambda *a, t=torch_s, o=onednn_s, **k: {"F.linear": t, "oneDNN": o})
        assert cpu_linear.onednn_pays() is expected
    cpu_linear._decide_onednn.cache_clear()


def test_auto_takes_the_few_rows_kernel_only_past_the_margin_and_never_slower_for_a_decode(monkeypatch):
    """Its probe runs at a decode's and a verify chunk's rows (FEW_ROWS = (1, 5))."""
    monkeypatch.delenv("WORKBENCH_CPU_GEMM", raising=False)
    for (torch_1, few_1), (torch_5, few_5), expected in (
            ((2.0, 1.0), (4.0, 1.0), True),   # 3x over both
            ((1.2, 1.0), (4.0, 1.0), True),   # 1.2x for a decode, 2.6x over both
            ((1.0, 1.1), (9.0, 1.0), False),  # slower for a decode
            ((1.3, 1.0), (1.6, 1.0), False)):  # 1.45x over both: inside the margin
        cpu_linear._decide_few_rows.cache_clear()
        results = {1: {"F.linear": torch_1, "few-rows": few_1}, 5: {"F.linear": torch_5, "few-rows": few_5}}
        monkeypatch.setattr(cpu_linear, "probe", lambda out, inp, rows, r=results, **k: r[rows])
        assert cpu_linear.few_rows_pays() is expected
    cpu_linear._decide_few_rows.cache_clear()


def test_the_few_rows_kernel_takes_1_to_8_rows_of_an_output_major_weight(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "numba")
    calls = []
    monkeypatch.setattr(cpu_few_rows, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or F.linear(x, w, b))
    output_major, bias = torch.randn(1024, 192), torch.randn(1024)
    for rows in (1, 5, 8, 9, 64):
        cpu_linear.linear(torch.randn(rows, 192), output_major, bias, cpu_linear.PackedWeight())
    cpu_linear.linear(torch.randn(5, 192), _weight(), bias)  # input-major: torch's path
    assert calls == [1, 5, 8]
    with batch_invariant.batch_invariant_mode():
        cpu_linear.linear(torch.randn(5, 192), output_major)
    assert calls == [1, 5, 8]


def test_the_environment_pins_the_choice_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "torch")
    packed, weight = cpu_linear.PackedWeight(), _weight()
    cpu_linear.linear(torch.randn(5, 192), weight, None, packed)
    assert packed.nbytes == 0 and cpu_linear.describe() == "F.linear"
    assert not cpu_linear.few_rows_pays()
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "onednn")
    assert cpu_linear.describe().startswith(f"oneDNN from {cpu_linear.MIN_ROWS} rows")
    assert not cpu_linear.few_rows_pays()
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "numba")
    assert cpu_linear.few_rows_pays() and not cpu_linear.onednn_pays()
    assert cpu_linear.describe() == f"the few-rows kernel up to {cpu_few_rows.MAX_ROWS} rows, else F.linear"
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="WORKBENCH_CPU_GEMM must be one of"):
        cpu_linear.onednn_pays()


def test_only_large_fp32_cpu_weights_are_packable():
    assert cpu_linear.packable(_weight(1024, 192))
    assert not cpu_linear.packable(_weight(384, 192))  # under MIN_ELEMENTS: oneDNN's call cost
    assert not cpu_linear.packable(_weight(1024, 192).half())
    assert not cpu_linear.packable(torch.randn(1 << 18))


def test_the_loaded_model_packs_its_large_weights():
    from workbench.model.loader import default_model_path, load_model
    from workbench.model.model_config import ModelConfig

    model = load_model(ModelConfig.from_pretrained(default_model_path()), device="cpu")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.packed is attn.o_proj.packed is mlp.down_proj.packed is None  # small
    assert mlp.gate_up_proj.packed is not None and model.lm_head_packed is not None


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_tokens_are_the_same_on_either_path(monkeypatch, speculative):
    from workbench import LLM, SamplingParams

    prompts = ["To be, or not to be, that is the question: to be, or not",
               "ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}} if speculative else {}
    tokens = {}
    for path in ("torch", "onednn", "numba"):
        monkeypatch.setenv("WORKBENCH_CPU_GEMM", path)
        llm = LLM(model="tiny-shakespeare", max_num_seqs=2, **extra)
        tokens[path] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["torch"] == tokens["onednn"] == tokens["numba"]


def test_a_torch_without_onednn_never_takes_it_even_pinned(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "onednn")
    cpu_linear._decide_onednn.cache_clear()
    try:
        assert not cpu_linear.onednn_pays()
        assert "oneDNN" not in cpu_linear.probe(256, 64, rows=5, rounds=2)
        x, weight, packed = torch.randn(5, 192), _weight(), cpu_linear.PackedWeight()
        torch.testing.assert_close(cpu_linear.linear(x, weight, None, packed), F.linear(x, weight))
        assert packed.nbytes == 0
    finally:
        cpu_linear._decide_onednn.cache_clear()
