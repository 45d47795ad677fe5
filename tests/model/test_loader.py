"""Model resolution and loading: local dirs, hub ids offline / unreachable, config validation,
sharded and broken safetensors checkpoints."""

from __future__ import annotations

import json
import time

import huggingface_hub.constants
import pytest
import torch
import transformers
from safetensors.torch import save_file

from workbench.model import loader
from workbench.model.loader import ModelLoadError, load_model, resolve_model_path
from workbench.model.model_config import ModelConfig

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().eval()


def _write_config(path, **overrides) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, **overrides}
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_is_named(tmp_path):
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_pretrained(tmp_path)
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert supported in str(info.value)


def test_architecture_from_model_type_when_list_absent(tmp_path):
    _write_config(tmp_path, architectures=None, model_type="qwen3")
    assert ModelConfig.from_pretrained(tmp_path).architecture == "Qwen3ForCausalLM"


def test_max_model_len_over_position_embeddings(tmp_path):
    _write_config(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len \(4096\).*max_position_embeddings \(64\)"):
        ModelConfig.from_pretrained(tmp_path, max_model_len=4096)
    assert ModelConfig.from_pretrained(tmp_path).max_model_len == 64


def test_unsupported_rope_type_is_named(tmp_path):
    _write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_pretrained(tmp_path)


def test_classic_rope_fields(tmp_path):
    _write_config(tmp_path, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_dtype_auto_and_explicit(tmp_path):
    _write_config(tmp_path, torch_dtype="bfloat16")
    assert ModelConfig.from_pretrained(tmp_path, device="cpu").dtype == torch.float32
    assert ModelConfig.from_pretrained(tmp_path, device="cuda").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(tmp_path, dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(tmp_path, dtype="int8")


def test_eos_ids_merge_generation_config(tmp_path):
    _write_config(tmp_path, eos_token_id=2, bos_token_id=1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_ids == [2, 7] and cfg.bos_token_id == 1


def test_qwen2_sliding_window_only_when_enabled(tmp_path):
    _write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=False)
    assert ModelConfig.from_pretrained(tmp_path).sliding_window is None
    _write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
                  max_window_layers=1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    assert [cfg.layer_sliding_window(i) for i in range(2)] == [None, 16]


def test_local_dir_resolves_to_itself(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_missing_local_path_is_named(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="nope"):
        resolve_model_path(missing)


def test_hub_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="Could not load model 'workbench-test/not-cached'") as info:
        resolve_model_path("workbench-test/not-cached")
    assert time.monotonic() - start < 10
    assert "HF_HUB_OFFLINE" in str(info.value) and isinstance(info.value, OSError)


def test_hub_unreachable_fails_fast(monkeypatch, tmp_path):
    """Online mode, but the hub endpoint refuses connections (a closed local port)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="Could not load model 'workbench-test/unreachable'.*reached"):
        resolve_model_path("workbench-test/unreachable")
    assert time.monotonic() - start < 10


def test_default_model_path(monkeypatch, tmp_path):
    monkeypatch.setattr(loader.importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(FileNotFoundError, match="tiny-shakespeare"):
        loader.default_model_path()
    (tmp_path / "tiny-shakespeare").mkdir()
    _write_config(tmp_path / "tiny-shakespeare")
    assert resolve_model_path(None) == tmp_path / "tiny-shakespeare"


def test_sharded_checkpoint_loads_every_tensor(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(ModelConfig.from_pretrained(tmp_path), device="cpu")
    ours = model.hf_state_dict()
    theirs = tiny_llama.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_missing_and_misshapen_tensors_are_named(tiny_llama, tmp_path):
    _write_config(tmp_path)
    weights = {k: v.clone().contiguous() for k, v in tiny_llama.state_dict().items()}
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(config, device="cpu")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(3, 3\).*\(48, 32\)"):
        load_model(config, device="cpu")


def test_no_weights_and_bad_load_format(tmp_path):
    _write_config(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(config, device="cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(config, device="cpu", load_format="pt")
    assert load_model(config, device="cpu", load_format="dummy").embed_tokens.shape == (128, 32)


def test_model_config_repr_is_machine_independent(tmp_path):
    (tmp_path / "tiny").mkdir()
    _write_config(tmp_path / "tiny", rope_theta=500000.0)
    cfg = ModelConfig.from_pretrained(tmp_path / "tiny", max_model_len=32)
    assert repr(cfg) == (
        "ModelConfig(model='tiny', architecture='LlamaForCausalLM', dtype='float32', layers=2, "
        "hidden_size=32, heads='4 q / 2 kv x 8', intermediate_size=48, vocab_size=128, "
        "max_model_len=32, rope='default, theta=500000', sliding_window=None, "
        "tie_word_embeddings=False)"
    )
    assert str(tmp_path) not in cfg._repr_html_() and "<table>" in cfg._repr_html_()
