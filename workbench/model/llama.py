"""The native Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over the paged KV cache.

One implementation, switched by the ModelConfig flags: ``qkv_bias`` (Qwen2), ``qk_norm``
(Qwen3: RMSNorm over each head of q and k before RoPE), ``sliding_window`` (Mistral, or Qwen
layers marked "sliding_attention"), ``tie_word_embeddings``. q/k/v and gate/up are fused into
one matmul each; :meth:`LlamaForCausalLM.hf_weight_map` maps Hugging Face tensor names onto
row ranges of the fused weights, both for loading and for exporting (:meth:`hf_state_dict`).

The forward runs on the packed batch: ``input_ids`` and ``positions`` hold every scheduled
token of every sequence, and :class:`~workbench.model.attention.AttentionMetadata` says where
each sequence starts and which cache slots its tokens use. All kernels come from
``workbench.kernels`` with ``backend=attn.backend``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.kernels import cpu_linear, ops
from workbench.model.attention import AttentionMetadata
from workbench.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from workbench.model.rotary import build_cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights come from a checkpoint or the dummy init)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Linear(nn.Module):
    """y = x @ weight.T (+ bias); ``shards`` names the row blocks of a fused weight. ``packed``:
    the weight's oneDNN copy for several rows (:meth:`LlamaForCausalLM.pack_weights`) or None."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, dtype, device):
        super().__init__()
        self.shards = dict(shards)
        out_features = sum(shards.values())
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias, self.packed)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        fused = "+".join(f"{k}:{v}" for k, v in self.shards.items()) if len(self.shards) > 1 else ""
        return (f"in={in_features}, out={out_features}" + (f" ({fused})" if fused else "")
                + f", bias={self.bias is not None}")


class _RMSNormWeight(nn.Module):
    """Holds an RMSNorm weight; the computation is ``workbench.kernels.ops.rms_norm``."""

    def __init__(self, size: int, dtype, device):
        super().__init__()
        self.weight = _param((size,), dtype, device)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}"


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm, RoPE, paged KV write + attention."""

    def __init__(self, config: ModelConfig, layer: int, device):
        super().__init__()
        c, dt = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.eps = c.rms_norm_eps
        self.sliding_window = c.layer_sliding_window(layer)
        self.qkv_proj = _Linear(
            c.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, c.qkv_bias, dt, device
        )
        self.o_proj = _Linear(self.q_size, {"o": c.hidden_size}, c.o_bias, dt, device)
        self.q_norm = _RMSNormWeight(c.head_dim, dt, device) if c.qk_norm else None
        self.k_norm = _RMSNormWeight(c.head_dim, dt, device) if c.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # q, k, v are strided views of the fused projection's output (every kernel takes views)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps,
                             backend=attn.backend).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps,
                             backend=attn.backend).view_as(k)
        ops.rotary_embedding(positions, q, k, cos_sin_cache, backend=attn.backend,
                             plan=attn.plan)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(k, v, key_cache, value_cache, attn.slot_mapping, backend=attn.backend)
        out = ops.paged_attention(
            q, key_cache, value_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens,
            self.scale, sliding_window=self.sliding_window, backend=attn.backend, plan=attn.plan,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}")


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, device):
        super().__init__()
        c = config
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = _Linear(
            c.hidden_size, {"gate": c.intermediate_size, "up": c.intermediate_size}, c.mlp_bias, c.dtype, device
        )
        self.down_proj = _Linear(c.intermediate_size, {"down": c.hidden_size}, c.mlp_bias, c.dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so that each RMSNorm also does
    the residual add (``ops.rms_norm(x, w, eps, residual)`` -> (normed, x + residual))."""

    def __init__(self, config: ModelConfig, layer: int, device):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _RMSNormWeight(config.hidden_size, config.dtype, device)
        self.self_attn = LlamaAttention(config, layer, device)
        self.post_attention_layernorm = _RMSNormWeight(config.hidden_size, config.dtype, device)
        self.mlp = LlamaMLP(config, device)

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, attn):
        if residual is None:
            residual = x
            h = ops.rms_norm(x, self.input_layernorm.weight, self.eps, backend=attn.backend)
        else:
            h, residual = ops.rms_norm(x, self.input_layernorm.weight, self.eps, residual,
                                       backend=attn.backend)
        h = self.self_attn(h, positions, cos_sin_cache, kv_cache, attn)
        h, residual = ops.rms_norm(h, self.post_attention_layernorm.weight, self.eps, residual,
                                   backend=attn.backend)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus LM head. Parameters are frozen (no autograd graph is built).

    ``forward`` returns the final hidden states of every packed token; ``compute_logits`` projects
    only the rows the runner gathers (e.g. each sampling sequence's last token) to float32 logits.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Model architecture {config.architecture} is not supported; supported "
                f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        self.config = config
        dt = config.dtype
        self.embed_tokens = _param((config.vocab_size, config.hidden_size), dt, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, device) for i in range(config.num_layers))
        self.norm = _RMSNormWeight(config.hidden_size, dt, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param((config.vocab_size, config.hidden_size), dt, device))
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(config.head_dim, config.max_model_len, config.rope_theta,
                                config.rope_scaling, device=device),
            persistent=False,
        )
        self.lm_head_packed: cpu_linear.PackedWeight | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model has {len(self.layers)}.")
        if attn.plan is None:
            attn = dataclasses.replace(attn, plan=ops.plan_attention(
                attn.block_tables, attn.query_start_loc, attn.seq_lens, kv_caches[0][0].shape[1],
                backend=attn.backend))
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.cos_sin_cache, kv_cache, attn)
        x, _ = ops.rms_norm(x, self.norm.weight, self.config.rms_norm_eps, residual, backend=attn.backend)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], float32."""
        return cpu_linear.linear(hidden, self.lm_head, None, self.lm_head_packed).float()

    def pack_weights(self) -> None:
        """Give every projection and the LM head a fresh oneDNN copy for products of several
        rows where :func:`workbench.kernels.cpu_linear.packable` allows one (large fp32 CPU
        weights), None otherwise. A copy is made at the first product that takes it and then
        follows the weight (:mod:`workbench.kernels.cpu_linear`); the loader calls this after
        every load."""
        def copy_for(weight: torch.Tensor) -> cpu_linear.PackedWeight | None:
            return cpu_linear.PackedWeight() if cpu_linear.packable(weight) else None

        linears = [m for m in self.modules() if isinstance(m, _Linear)]
        for linear in linears:
            linear.packed = copy_for(linear.weight)
        self.lm_head_packed = copy_for(self.lm_head)
        if self.lm_head_packed is not None or any(linear.packed is not None for linear in linears):
            cpu_linear.onednn_pays()  # the probe runs now (once per process), not in a first step

    def release_packed_weights(self) -> None:
        """Free the oneDNN copies (sleep mode); they are made again at the next use."""
        for linear in self.modules():
            if isinstance(linear, _Linear) and linear.packed is not None:
                linear.packed.release()
        if self.lm_head_packed is not None:
            self.lm_head_packed.release()

    # ---- weights -------------------------------------------------------------------------

    def hf_weight_map(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face tensor name -> (parameter, first row, number of rows) it occupies.

        Fused weights (qkv_proj, gate_up_proj) appear once per Hugging Face projection; a tied
        ``lm_head.weight`` is not listed (it is ``model.embed_tokens.weight``).
        """
        table: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, p: torch.Tensor) -> None:
            table[name] = (p, 0, p.shape[0])

        def fused(prefix: str, linear: _Linear) -> None:
            start = 0
            for shard, rows in linear.shards.items():
                table[f"{prefix}.{shard}_proj.weight"] = (linear.weight, start, rows)
                if linear.bias is not None:
                    table[f"{prefix}.{shard}_proj.bias"] = (linear.bias, start, rows)
                start += rows

        whole("model.embed_tokens.weight", self.embed_tokens)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            fused(f"{p}.self_attn", attn.qkv_proj)
            fused(f"{p}.self_attn", attn.o_proj)
            if attn.q_norm is not None:
                whole(f"{p}.self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{p}.self_attn.k_norm.weight", attn.k_norm.weight)
            fused(f"{p}.mlp", mlp.gate_up_proj)
            fused(f"{p}.mlp", mlp.down_proj)
            whole(f"{p}.input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        whole("model.norm.weight", self.norm.weight)
        if not self.config.tie_word_embeddings:
            whole("lm_head.weight", self.lm_head)
        return table

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters, casting to the model dtype.

        Every tensor of :meth:`hf_weight_map` must come exactly once; an unknown name, a wrong
        shape or a missing tensor raises ValueError naming it. Rotary ``inv_freq`` buffers and a
        redundant ``lm_head.weight`` of a tied model are ignored.
        """
        table = self.hf_weight_map()
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            if name not in table:
                unexpected.append(name)
                continue
            param, start, rows = table[name]
            target = param.data[start:start + rows]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"Weight {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"({self.config.architecture}) expects {tuple(target.shape)}."
                )
            target.copy_(tensor)
            seen.add(name)
        if unexpected:
            raise ValueError(
                f"Checkpoint has {len(unexpected)} tensor(s) the {self.config.architecture} model does "
                f"not use, e.g. {', '.join(sorted(unexpected)[:5])}."
            )
        missing = sorted(set(table) - seen)
        if missing:
            raise ValueError(
                f"Checkpoint lacks {len(missing)} tensor(s) the {self.config.architecture} model needs, "
                f"e.g. {', '.join(missing[:5])}."
            )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names (views, not copies): loadable by transformers."""
        return {name: p.data[start:start + rows] for name, (p, start, rows) in self.hf_weight_map().items()}

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Seeded random weights at real shapes: norm weights 1, everything else N(0, 0.02).

        Deterministic for a given seed and device (the generator lives on the weights' device)."""
        device = self.embed_tokens.device
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=gen)


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
CausalLM = LlamaForCausalLM


def allocate_kv_caches(
    model_config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str
) -> list[KVCache]:
    """One zeroed (key_cache, value_cache) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype."""
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    return [
        (torch.zeros(shape, dtype=model_config.dtype, device=device),
         torch.zeros(shape, dtype=model_config.dtype, device=device))
        for _ in range(model_config.num_layers)
    ]
