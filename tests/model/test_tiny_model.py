"""The embedded tiny Shakespeare model (data/tiny-shakespeare): loads, reads well, tokenizes.

These tests load the shipped checkpoint with Hugging Face transformers (the reference
implementation); they never retrain. Readability is judged against the word list of the
committed training corpus (data/shakespeare/corpus, minus the held-out plays).
"""

from __future__ import annotations

import gzip
import json
import re
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

DATA = Path(str(files("workbench.data")))
MODEL_DIR = DATA / "tiny-shakespeare"
CORPUS_DIR = DATA / "shakespeare" / "corpus"

SPEAKERS = ["ROMEO:", "JULIET:", "KING HENRY:", "HAMLET:", "MACBETH:",
            "OTHELLO:", "PORTIA:", "FALSTAFF:", "BRUTUS:", "LEAR:"]


def words(text: str) -> list[str]:
    """Normalised words: lowercase, punctuation (anything but letters, digits, apostrophes)
    replaced by spaces, split on whitespace, leading/trailing apostrophes stripped."""
    out = []
    for w in re.sub(r"[^\w']+", " ", text.lower()).split():
        w = w.strip("'_")
        if w and not w.isdigit():
            out.append(w)
    return out


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def corpus_words() -> set[str]:
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    held_out = set(manifest["held_out"])
    vocab: set[str] = set()
    for f in sorted(CORPUS_DIR.glob("*.txt.gz")):
        if f.name[: -len(".txt.gz")] not in held_out:
            vocab.update(words(gzip.decompress(f.read_bytes()).decode("utf-8")))
    return vocab


def test_words_normalisation_hand_worked():
    assert words("O Romeo, Romeo! wherefore art thou--Romeo? 'Tis 1597.") == [
        "o", "romeo", "romeo", "wherefore", "art", "thou", "romeo", "tis"]


def test_corpus_is_clean_and_split_by_play(corpus_words):
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    names = {f.name[: -len(".txt.gz")] for f in CORPUS_DIR.glob("*.txt.gz")}
    assert names == set(manifest["works"]) and len(names) >= 40
    assert set(manifest["held_out"]) < names and len(manifest["held_out"]) >= 2
    for f in CORPUS_DIR.glob("*.txt.gz"):
        text = gzip.decompress(f.read_bytes()).decode("utf-8")
        assert "gutenberg" not in text.lower(), f.name
        assert "\r" not in text, f.name
    assert {"romeo", "wherefore", "thou", "prithee"} <= corpus_words


def test_checkpoint_loads_unchanged_with_gqa():
    model, info = AutoModelForCausalLM.from_pretrained(MODEL_DIR, output_loading_info=True)
    assert all(not v for v in info.values()), info  # no missing/unexpected/mismatched keys
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    assert cfg.num_attention_heads // cfg.num_key_value_heads in (2, 4)
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim in (32, 64)
    assert cfg.max_position_embeddings >= 1024
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 10_000_000, n_params
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total <= 30 * 1024 * 1024, f"model dir is {total / 2**20:.1f} MiB, limit 30 MiB"


def test_generation_config_matches_tokenizer(tok, model):
    gc = model.generation_config
    assert (gc.bos_token_id, gc.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.config.eos_token_id == tok.eos_token_id
    assert tok.convert_ids_to_tokens([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]) == [
        "<|bos|>", "<|eos|>", "<|pad|>"]
    # Encoding a prompt starts it with exactly one BOS, as every training passage does.
    ids = tok("ROMEO:")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]


def test_sampled_continuations_are_readable(tok, model, corpus_words):
    """>= 90% of generated words (normalised as in words()) occur in the training corpus."""
    generated = []
    for i, prompt in enumerate(SPEAKERS):
        torch.manual_seed(1000 + i)
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                                 max_new_tokens=64, pad_token_id=tok.pad_token_id)
        generated.append(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    all_words = [w for text in generated for w in words(text)]
    known = [w for w in all_words if w in corpus_words]
    ratio = len(known) / len(all_words)
    unknown = sorted({w for w in all_words if w not in corpus_words})
    print(f"readability {ratio:.1%} of {len(all_words)} words; unknown: {unknown}")
    assert len(all_words) >= 200, generated
    assert ratio >= 0.90, (ratio, unknown, generated)


def test_decode_is_clean_text(tok):
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text) / 2  # BPE merges, not bytes
    decoded = tok.decode(ids)
    assert decoded == text and "Ġ" not in decoded and "Ċ" not in decoded


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_unicode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_chat_template_two_turns(tok):
    messages = [
        {"role": "user", "content": "What light through yonder window breaks?"},
        {"role": "assistant", "content": "It is the east, and Juliet is the sun."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert messages[0]["content"] in text and messages[1]["content"] in text
    assert text.index(messages[0]["content"]) < text.index(messages[1]["content"])
    assert text.startswith("<|bos|>") and text.endswith("JULIET:\n")
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("JULIET:\n")
    # Hand-worked rendering: the user speaks as ROMEO, the assistant as JULIET.
    three = messages + [{"role": "user", "content": "Speak again."}]
    assert tok.apply_chat_template(three, tokenize=False, add_generation_prompt=True) == (
        "<|bos|>ROMEO:\nWhat light through yonder window breaks?\n\n"
        "JULIET:\nIt is the east, and Juliet is the sun.\n\n"
        "ROMEO:\nSpeak again.\n\nJULIET:\n"
    )
    ids = tok.apply_chat_template(three, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok(tok.apply_chat_template(three, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1


def test_chat_replies_stop_by_themselves(tok, model):
    """Sampled replies to a chat prompt end with <|eos|> (every training passage ends with it)."""
    messages = [{"role": "user", "content": "Good morrow, fair lady. How fares your father?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    ended = []
    for seed in range(5):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                                 max_new_tokens=256, pad_token_id=tok.pad_token_id)
        ended.append(out[0, -1].item() == tok.eos_token_id)
    assert sum(ended) >= 4, ended
