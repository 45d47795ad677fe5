"""Reading PEFT adapters (scaling exactly as PEFT's, every bad adapter refused naming its file
and the rule) and the adapter slots (LRU in host memory and on the device, pinning)."""

from __future__ import annotations

import json

import pytest
import torch
from lora_support import make_peft_adapter
from safetensors.torch import load_file, save_file

from workbench.lora.models import LoRAModel, LoRAModelManager

HIDDEN, INTER, KV = 192, 512, 96
EXPECTED = {}
for i in range(4):
    for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (HIDDEN, KV)),
                        ("self_attn.v_proj", (HIDDEN, KV)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
                        ("mlp.gate_proj", (HIDDEN, INTER)), ("mlp.up_proj", (HIDDEN, INTER)),
                        ("mlp.down_proj", (INTER, HIDDEN))):
        EXPECTED[f"model.layers.{i}.{name}"] = shape


def load(path, max_lora_rank=16):
    return LoRAModel.from_local_checkpoint(path, 1, "a", expected_modules=EXPECTED,
                                           max_lora_rank=max_lora_rank)


@pytest.mark.parametrize("rslora", [False, True])
def test_scaling_and_weights_are_peft_s(tmp_path, rslora):
    peft_model = make_peft_adapter(tmp_path, r=4, alpha=12, rslora=rslora,
                                   targets=("q_proj", "down_proj"))
    lora = load(tmp_path)
    layer = peft_model.base_model.model.model.layers[2]
    for name, module in (("self_attn.q_proj", layer.self_attn.q_proj), ("mlp.down_proj", layer.mlp.down_proj)):
        scaling = module.scaling["default"]  # PEFT's own number
        assert scaling == pytest.approx(12 / (2.0 if rslora else 4.0))
        w = lora.loras[f"model.layers.2.{name}"]
        torch.testing.assert_close(w.lora_a, module.lora_A["default"].weight, atol=0, rtol=0)
        torch.testing.assert_close(w.lora_b, module.lora_B["default"].weight * scaling, atol=1e-7, rtol=1e-6)
    assert lora.rank == 4 and len(lora.loras) == 8


@pytest.fixture()
def adapter(tmp_path):
    make_peft_adapter(tmp_path, r=4, targets=("q_proj", "v_proj"))
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensors(path, fn):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("breakage, file, rule", [
    (lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors", "no such file"),
    (lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json", "no such file"),
    (lambda p: (p / "adapter_config.json").write_text("{"), "adapter_config.json", "not a JSON file"),
    (lambda p: edit_config(p, r=32), "adapter_config.json", "LoRA rank 32 is greater than max_lora_rank 16"),
    (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]), "adapter_config.json",
     "target modules ['lm_head'] are not LoRA-able"),
    (lambda p: edit_config(p, use_dora=True), "adapter_config.json", "use_dora=True is not supported"),
    (lambda p: edit_tensors(p, lambda t: t.update({KEY.replace("layers.0", "layers.9"): t[KEY].clone()})),
     "adapter_model.safetensors", "targets module 'model.layers.9.self_attn.q_proj', which the model lacks"),
    (lambda p: edit_tensors(p, lambda t: t.update({KEY: torch.zeros(4, 100)})),
     "adapter_model.safetensors", "lora_A.weight has shape (4, 100), expected (4, 192)"),
    (lambda p: edit_tensors(p, lambda t: t.pop(KEY.replace("lora_A", "lora_B"))),
     "adapter_model.safetensors", "has lora_A only"),
    (lambda p: edit_tensors(p, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2)})),
     "adapter_model.safetensors", "is not a LoRA A/B weight"),
])
def test_a_bad_adapter_is_refused_naming_the_file_and_the_rule(adapter, breakage, file, rule):
    breakage(adapter)
    with pytest.raises(ValueError) as info:
        load(adapter)
    assert str(adapter / file) in str(info.value) and rule in str(info.value)


class Slots:
    """Records what the manager writes into device slots."""

    def __init__(self, max_loras, max_cpu_loras):
        self.content = {}
        self.m = LoRAModelManager(max_loras, max_cpu_loras, self.write, self.clear)

    def write(self, slot, model):
        assert slot >= 1 and slot not in self.content
        self.content[slot] = model.id

    def clear(self, slot):
        self.content.pop(slot, None)

    def add(self, *ids):
        return [self.m.add_adapter(LoRAModel(i, f"l{i}", 1, 1.0, {})) for i in ids]


def test_device_slots_are_lru_and_pinned_adapters_stay():
    s = Slots(max_loras=2, max_cpu_loras=4)
    assert s.add(1, 2, 3) == [True, True, True] and s.add(1) == [False]
    assert s.m.activate([1, 2]) == {1: 1, 2: 2}
    assert s.m.activate([3]) == {3: 1}  # 1 was the least recently used
    assert s.content == {1: 3, 2: 2}
    assert s.m.pin_adapter(2)
    assert s.m.activate([1]) == {1: 1} and s.m.activate([3]) == {3: 1}  # 2 is pinned: never chosen
    assert s.content == {1: 3, 2: 2}
    with pytest.raises(RuntimeError, match="max_loras=2"):
        s.m.activate([1, 3, 2])
    assert s.m.activate([1, 2]) == {1: 1, 2: 2}  # 3 leaves (not in the batch), 2 stays put
    with pytest.raises(ValueError, match="LoRA 9 is not registered"):
        s.m.pin_adapter(9)


def test_host_memory_is_lru_and_removal_frees_the_slot():
    s = Slots(max_loras=1, max_cpu_loras=2)
    s.add(1, 2)
    s.m.activate([1])
    s.add(3)  # host memory full: 2 is the LRU (1 was used since)
    assert s.m.list_adapters() == {1, 3}
    s.m.pin_adapter(3)
    s.add(4)  # 1 is the only unpinned one
    assert s.m.list_adapters() == {3, 4} and s.content == {1: 3}
    assert s.m.remove_adapter(3) and not s.m.remove_adapter(3)
    assert s.content == {} and s.m.list_adapters() == {4}
    s.m.pin_adapter(4)
    s.add(5)
    with pytest.raises(RuntimeError, match="all max_loras=1 slots are pinned"):
        s.m.pin_adapter(5)  # pinning takes a device slot, and the only one is pinned
    both = Slots(max_loras=2, max_cpu_loras=2)
    both.add(1, 2)
    both.m.pin_adapter(1), both.m.pin_adapter(2)
    with pytest.raises(RuntimeError, match="CPU LoRA slots .* hold pinned adapters"):
        both.add(3)
