"""CPU weights are stored output-major after loading where the few-rows kernel pays, input-major
elsewhere (and again after a reload, as sleep level 2 does): same shapes and values as the
checkpoint's row-major tensors, and the same projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.model.loader import default_model_path, load_model, load_weights, iterate_safetensors
from workbench.model.model_config import ModelConfig


def _input_major(p: torch.Tensor) -> bool:
    return p.t().is_contiguous() and not p.is_contiguous()


@pytest.fixture(params=["torch", "numba"])
def layout(request, monkeypatch):
    """The layout the loader gives each CPU linear choice: "input" without the few-rows kernel."""
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", request.param)
    return "input" if request.param == "torch" else "output"


def _stored(p: torch.Tensor, layout: str) -> bool:
    return _input_major(p) if layout == "input" else p.is_contiguous()


def test_loaded_weights_are_stored_for_their_products_with_the_checkpoints_values(layout):
    config = ModelConfig.from_pretrained(default_model_path())
    model = load_model(config, device="cpu")
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    assert len(matrices) == 1 + 4 * config.num_layers  # embeddings (tied LM head) + 4 per layer
    assert all(_stored(p, layout) for p in matrices.values())
    assert model.lm_head is model.embed_tokens
    checkpoint = dict(iterate_safetensors(config.path))
    for name, tensor in model.hf_state_dict().items():
        assert torch.equal(tensor, checkpoint[name]), name
    # the projections are those of the row-major weights
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for linear in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj):
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight.contiguous()))
    torch.testing.assert_close(model.compute_logits(x), x @ model.lm_head.contiguous().t())
    ids = torch.tensor([3, 0, 4095])
    assert torch.equal(F.embedding(ids, model.embed_tokens), model.embed_tokens.contiguous()[ids])


def test_a_reload_into_fresh_tensors_is_stored_so_again(layout):
    """Sleep level 2 frees the weights and reloads the checkpoint into new row-major tensors."""
    config = ModelConfig.from_pretrained(default_model_path())
    model = load_model(config, device="cpu", load_format="dummy", seed=3)
    before = {name: p.clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.data = torch.empty(p.shape, dtype=p.dtype)
    assert not any(_input_major(p) for p in model.parameters())
    load_weights(model, config, load_format="dummy", seed=3)
    assert all(_stored(p, layout) for p in model.parameters() if p.dim() == 2)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
