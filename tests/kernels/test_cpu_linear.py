"""The CPU linear path: oneDNN on a packed copy for several rows equals ``F.linear``, the copy
follows its weight, the choice is the probe's (or the environment's), and a model forced onto
either path generates the same greedy tokens, with and without speculation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.kernels import batch_invariant, cpu_linear


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
        cpu_linear._decide.cache_clear()
        monkeypatch.setattr(cpu_linear, "probe", lambda *a, t=torch_s, o=onednn_s: (t, o))
        assert cpu_linear.onednn_pays() is expected
    cpu_linear._decide.cache_clear()


def test_the_environment_pins_the_choice_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "torch")
    packed, weight = cpu_linear.PackedWeight(), _weight()
    cpu_linear.linear(torch.randn(5, 192), weight, None, packed)
    assert packed.nbytes == 0 and cpu_linear.describe() == "F.linear"
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "onednn")
    assert cpu_linear.describe().startswith(f"oneDNN from {cpu_linear.MIN_ROWS} rows")
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
    for path in ("torch", "onednn"):
        monkeypatch.setenv("WORKBENCH_CPU_GEMM", path)
        llm = LLM(model="tiny-shakespeare", max_num_seqs=2, **extra)
        tokens[path] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["torch"] == tokens["onednn"]
