"""Shared by the LoRA tests: PEFT adapters for the embedded model, made with peft itself."""

from __future__ import annotations

import torch
import transformers

from workbench import default_model_path


def base_model():
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_path(),
                                                            dtype=torch.float32).eval()


def make_peft_adapter(path, *, r=4, alpha=8, rslora=False, targets=("q_proj", "v_proj"),
                      seed=0, std=0.3):
    """A PEFT LoRA adapter with random A and B (peft's init leaves B zero: no effect) saved in
    ``path``; returns the PeftModel (on a fresh base)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base_model(), LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets), lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(path)
    return model.eval()
