"""Native Llama-family model vs Hugging Face transformers on the same weights (fp32, CPU).

Small random HF models (Llama, Qwen2 with qkv bias and tied embeddings, Qwen3 with q/k norm,
Mistral with a sliding window that matters, Llama with linear and llama3 rope scaling) are saved
with save_pretrained and read back by our loader. The native model runs packed batches over a
paged KV cache with shuffled block ids; transformers runs each full sequence alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from workbench.model.attention import AttentionMetadata
from workbench.model.llama import allocate_kv_caches
from workbench.model.loader import load_model
from workbench.model.model_config import ModelConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 40
ATOL = 1e-4

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
SPECS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 6}),
    "llama-linear": (transformers.LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": (transformers.LlamaConfig, {"rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
}
MAIN = ["llama", "qwen2", "qwen3", "mistral"]


def _build_hf(name: str, path) -> torch.nn.Module:
    config_cls, extra = SPECS[name]
    config = config_cls(**BASE, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in pname else noise)  # biases and norms non-trivial too
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """name -> (model directory, transformers model), built once per session on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, _build_hf(name, path))
        return cache[name]

    return get


def _native(path, **kw):
    config = ModelConfig.from_pretrained(path, **kw)
    return config, load_model(config, device="cpu")


@torch.no_grad()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


class PagedRun:
    """Drives the native model the way a runner does: per sequence a block table of shuffled
    physical blocks; each step packs (new tokens, tokens already cached) of several sequences."""

    def __init__(self, model, config, num_seqs: int, seed: int = 0, backend: str = "torch"):
        self.model = model
        self.backend = backend
        self.kv = allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, "cpu")
        perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        per_seq = NUM_BLOCKS // num_seqs
        self.tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]

    def step(self, chunks: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """chunks: (sequence index, new token ids, tokens already cached) -> logits per chunk."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq, new, cached in chunks:
            table = self.tables[seq]
            for j, tok in enumerate(new):
                pos = cached + j
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            starts.append(starts[-1] + len(new))
            seq_lens.append(cached + len(new))
            tables.append(table)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            backend=self.backend,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv, attn)
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return [logits[starts[i]:starts[i + 1]] for i in range(len(chunks))]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(SPECS))
def test_packed_prefill_matches_transformers(hf_model, name):
    path, hf = hf_model(name)
    config, model = _native(path)
    prompts = [_tokens(n, seed=n) for n in (5, 11, 19)]
    run = PagedRun(model, config, num_seqs=len(prompts))
    outs = run.step([(i, p, 0) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(out, _hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MAIN)
def test_decode_steps_match_transformers(hf_model, name):
    path, hf = hf_model(name)
    config, model = _native(path)
    lens, steps = (3, 9, 14), 4
    seqs = [_tokens(n + steps, seed=100 + n) for n in lens]
    run = PagedRun(model, config, num_seqs=len(seqs), seed=1)
    run.step([(i, s[:n], 0) for i, (s, n) in enumerate(zip(seqs, lens))])
    refs = [_hf_logits(hf, s) for s in seqs]
    for k in range(steps):
        outs = run.step([(i, [s[n + k]], n + k) for i, (s, n) in enumerate(zip(seqs, lens))])
        for out, ref, n in zip(outs, refs, lens):
            assert out.shape == (1, BASE["vocab_size"])
            torch.testing.assert_close(out[0], ref[n + k], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MAIN)
def test_chunked_prefill_mixed_with_decode(hf_model, name):
    """Step 1: A's first chunk + B's whole prompt; step 2: A's second chunk + B's first decode."""
    path, hf = hf_model(name)
    config, model = _native(path)
    a, b = _tokens(18, seed=7), _tokens(10, seed=8)
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    run = PagedRun(model, config, num_seqs=2, seed=2)
    out_a1, out_b1 = run.step([(0, a[:7], 0), (1, b[:9], 0)])
    out_a2, out_b2 = run.step([(0, a[7:], 7), (1, b[9:], 9)])
    torch.testing.assert_close(torch.cat([out_a1, out_a2]), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([out_b1, out_b2]), ref_b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_triton_backend_chunked_prefill_matches_transformers(hf_model, name):
    """The same packed chunked-prefill + decode steps with every kernel on backend="triton"
    (the Triton interpreter on CPU, set up by conftest)."""
    path, hf = hf_model(name)
    config, model = _native(path)
    a, b = _tokens(18, seed=9), _tokens(10, seed=10)
    run = PagedRun(model, config, num_seqs=2, seed=3, backend="triton")
    out_a1, out_b1 = run.step([(0, a[:7], 0), (1, b[:9], 0)])
    out_a2, out_b2 = run.step([(0, a[7:], 7), (1, b[9:], 9)])
    torch.testing.assert_close(torch.cat([out_a1, out_a2]), _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([out_b1, out_b2]), _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_mistral_sliding_window_matters(hf_model):
    """The Mistral parity above is meaningful: without the window the model disagrees with HF."""
    path, hf = hf_model("mistral")
    config = ModelConfig.from_pretrained(path)
    assert config.sliding_window == 6 and set(config.layer_types) == {"sliding_attention"}
    full = dataclasses.replace(config, sliding_window=None)
    model = load_model(full, device="cpu")
    prompt = _tokens(19, seed=19)
    (out,) = PagedRun(model, full, num_seqs=1).step([(0, prompt, 0)])
    ref = _hf_logits(hf, prompt)
    torch.testing.assert_close(out[:6], ref[:6], atol=ATOL, rtol=0)  # inside the window: same
    assert (out[6:] - ref[6:]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["llama", "llama-linear", "llama-llama3"])
def test_cos_sin_cache_matches_transformers_rotary(hf_model, name):
    path, hf = hf_model(name)
    _, model = _native(path)
    positions = torch.arange(BASE["max_position_embeddings"])[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    half = BASE["head_dim"] // 2
    torch.testing.assert_close(model.cos_sin_cache[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(model.cos_sin_cache[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)


def test_config_fields_from_checkpoints(hf_model):
    qwen2 = ModelConfig.from_pretrained(hf_model("qwen2")[0])
    assert qwen2.architecture == "Qwen2ForCausalLM"
    assert qwen2.tie_word_embeddings and qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen2.sliding_window is None
    qwen3 = ModelConfig.from_pretrained(hf_model("qwen3")[0])
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16
    llama3 = ModelConfig.from_pretrained(hf_model("llama-llama3")[0])
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.rope_scaling["factor"] == 4.0
    llama = ModelConfig.from_pretrained(hf_model("llama")[0], max_model_len=32)
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.max_model_len) == (2, 4, 2, 32)
    # 2 layers x (K and V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    assert llama.kv_cache_bytes_per_block(16) == 2 * 2 * 16 * 2 * 16 * 4


def test_tied_model_shares_embedding_and_head(hf_model):
    path, hf = hf_model("qwen2")
    _, model = _native(path)
    assert model.lm_head is model.embed_tokens
    assert "lm_head.weight" not in model.hf_state_dict()
    torch.testing.assert_close(model.embed_tokens, hf.lm_head.weight, atol=0, rtol=0)


def test_dummy_weights_shapes_seed_and_parity(hf_model, tmp_path):
    """Dummy weights: HF's own shapes, reproducible per seed, and (exported to transformers)
    the same logits: the export path and the forward agree for random weights too."""
    path, hf = hf_model("qwen3")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())  # no weights needed
    config = ModelConfig.from_pretrained(tmp_path)
    m0 = load_model(config, device="cpu", load_format="dummy", seed=0)
    m0_again = load_model(config, device="cpu", load_format="dummy", seed=0)
    m1 = load_model(config, device="cpu", load_format="dummy", seed=1)
    sd0, sd0b, sd1 = m0.hf_state_dict(), m0_again.hf_state_dict(), m1.hf_state_dict()
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in sd0.items()} == hf_shapes
    assert all(torch.equal(sd0[k], sd0b[k]) for k in sd0)
    assert not torch.equal(sd0["model.layers.0.self_attn.q_proj.weight"],
                           sd1["model.layers.0.self_attn.q_proj.weight"])
    std = sd0["model.layers.1.mlp.down_proj.weight"].std().item()
    assert 0.015 < std < 0.025

    hf_dummy = transformers.AutoModelForCausalLM.from_config(hf.config).float().eval()
    hf_dummy.load_state_dict(sd0, strict=True)
    prompts = [_tokens(6, seed=60), _tokens(13, seed=61)]
    outs = PagedRun(m0, config, num_seqs=2).step([(i, p, 0) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, _hf_logits(hf_dummy, prompt), atol=ATOL, rtol=0)


def test_bfloat16_forward_close_to_fp32_reference(hf_model):
    """bf16 weights and KV cache (explicit dtype on CPU) stay close to the fp32 reference."""
    path, hf = hf_model("llama")
    config, model = _native(path, dtype="bfloat16")
    assert config.dtype == torch.bfloat16 and model.embed_tokens.dtype == torch.bfloat16
    prompt = _tokens(12, seed=12)
    (out,) = PagedRun(model, config, num_seqs=1).step([(0, prompt, 0)])
    ref = _hf_logits(hf, prompt)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
