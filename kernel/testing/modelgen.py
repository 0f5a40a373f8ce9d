"""Small Hugging Face-layout checkpoints built offline, for tests and benchmarks.

No machine here reaches a model hub, so this module makes models that `mlx_lm.load`
reads through exactly the code path a real checkpoint takes: a `transformers` config,
seeded torch weights saved with `save_pretrained`, and a BPE tokenizer (byte-level, or
SentencePiece-style with byte fallback) trained with `tokenizers` on the Python standard
library's own source files.

Build once and reuse through `cached_model(spec)`; a spec is a dict of `build_model`'s
keyword arguments, and `PRESETS` names the usual ones. Heavy imports (torch,
transformers, tokenizers) happen inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unikern.errors import ConfigError

# Bump when the output of train_tokenizer or build_model changes, so caches rebuild.
MODELGEN_VERSION = 3

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = {"user": "<|user|>", "assistant": "<|assistant|>", "system": "<|system|>"}
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values(), PAD_TOKEN]  # ids 0..5

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# How text is split before BPE. "gpt2": ByteLevel's own regex, as Llama 3 / GPT-2 ship it.
# "qwen2": Qwen's split (digits one by one, punctuation glued to the newlines after it) and
# NFC, exactly what transformers' Qwen2Tokenizer rebuilds around the vocab whatever
# tokenizer.json says, so qwen2 models must be trained with it to tokenize consistently.
# "spm": SentencePiece-style as Llama 2 ships it: spaces are '▁' and a word's first
# piece carries one, decode strips the text's first space, characters outside ASCII are
# <0xNN> byte tokens (byte fallback), so one of them always spans several tokens.
PRETOKENIZERS = ("gpt2", "qwen2", "spm")
FAMILY_PRETOKENIZER = {"llama": "gpt2", "qwen2": "qwen2", "qwen3": "qwen2"}
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
# Real checkpoints of each family ship these; mlx-lm's llama and qwen2 read only the
# top-level `rope_theta`, so it is written there as well as under `rope_parameters`.
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}

CORPUS_MAX_BYTES = 3_000_000
_CORPUS_MAX_FILE_BYTES = 200_000
# Test suites, data tables and the IDLE GUI are not representative Python source.
_CORPUS_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "idlelib", "encodings", "pydoc_data",
     "turtledemo", "__pycache__"}
)

_BUILD_KEYS = (
    "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "dtype", "tie_word_embeddings", "seed",
)
# Spec keys that may be left out; a spec without one hashes as before it existed.
_OPTIONAL_KEYS = ("tokenizer",)  # a PRETOKENIZERS entry; default: the family's
_SPEC_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 2048, "dtype": "float32",
                                  "tie_word_embeddings": False, "seed": 0}

PRESETS: dict[str, dict[str, Any]] = {
    # ~1M parameters: GQA, RoPE and four layers, built in about a second.
    "tiny-llama": dict(family="llama", hidden_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, intermediate_size=384, vocab_size=1024,
                       dtype="float32", tie_word_embeddings=False, seed=0),
    # tiny-llama's shape with a SentencePiece-style tokenizer (Llama 2's layout).
    "tiny-llama-spm": dict(family="llama", hidden_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, intermediate_size=384, vocab_size=1024,
                           dtype="float32", tie_word_embeddings=False, seed=0,
                           tokenizer="spm"),
    # Plain multi-head attention, q/k/v biases, tied embeddings, bfloat16 weights.
    "tiny-qwen2": dict(family="qwen2", hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=4, intermediate_size=192, vocab_size=1024,
                       dtype="bfloat16", tie_word_embeddings=True, seed=0),
    # Multi-query attention (one KV head) with q/k norms.
    "tiny-qwen3": dict(family="qwen3", hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=1, intermediate_size=192, vocab_size=1024,
                       dtype="float32", tie_word_embeddings=False, seed=0),
    # The benchmark sizes of DESIGN.md section 5: 4.98M and 81.8M parameters.
    "llama-5m": dict(family="llama", hidden_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, intermediate_size=1024, vocab_size=2048,
                     dtype="float32", tie_word_embeddings=False, seed=0),
    "llama-80m": dict(family="llama", hidden_size=768, num_layers=12, num_heads=12,
                      num_kv_heads=4, intermediate_size=2048, vocab_size=4096,
                      dtype="float32", tie_word_embeddings=False, seed=0),
}


def cache_root() -> Path:
    """Where built models live: `$UNIKERN_MODEL_CACHE` or ~/.cache/unikern/models.

    Each model is `<root>/<spec hash>`; trained tokenizers are `<root>/tokenizers/<hash>`.
    """
    override = os.environ.get("UNIKERN_MODEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "unikern" / "models"


def stdlib_corpus(max_bytes: int = CORPUS_MAX_BYTES, seed: int = 0) -> list[str]:
    """Texts of a seeded, deterministic selection of the stdlib's `*.py` files.

    The selection depends only on `seed` and the interpreter's stdlib, so it differs
    between Python versions but never between runs.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py")
        if not _CORPUS_SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
        and p.stat().st_size <= _CORPUS_MAX_FILE_BYTES
    )
    random.Random(seed).shuffle(paths)
    texts: list[str] = []
    total_bytes = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if total_bytes + len(text.encode("utf-8")) > max_bytes:
            continue
        texts.append(text)
        total_bytes += len(text.encode("utf-8"))
    return texts


def tokenizer_config(model_max_length: int = 2048) -> dict[str, Any]:
    """The `tokenizer_config.json` contents that go with a trained tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # byte-level BPE never needs one; Qwen2Tokenizer would invent it
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def train_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int = 1024, seed: int = 0,
                    *, pretokenizer: str = "gpt2") -> None:
    """Train a BPE tokenizer on stdlib source; write tokenizer(_config).json.

    Deterministic: the same arguments on the same interpreter write identical files.
    """
    from tokenizers import processors

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size={vocab_size} is below the 256 bytes + "
                          f"{len(SPECIAL_TOKENS)} special tokens a byte-level BPE needs")
    if pretokenizer not in PRETOKENIZERS:
        raise ConfigError(f"unknown pretokenizer {pretokenizer!r}; choose one of "
                          f"{list(PRETOKENIZERS)}")
    if pretokenizer == "spm":
        tokenizer = _train_spm(vocab_size, seed)
    else:
        tokenizer = _train_byte_level(vocab_size, seed, pretokenizer)
    # Every encoded prompt starts with <|bos|>, like a training document does.
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config())


def _train_byte_level(vocab_size: int, seed: int, pretokenizer: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if pretokenizer == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_corpus(seed=seed), trainer=trainer)
    return tokenizer


def _train_spm(vocab_size: int, seed: int) -> Any:
    """Llama 2's tokenizer.json layout: '▁' normalizer, no pre-tokenizer, byte fallback
    to <0xNN> tokens (ids right after the special tokens), and a decoder that mlx-lm
    recognises as SentencePiece's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                 normalizers.Replace(" ", "▁")])
    # training only: pieces start at a '▁', so no merge spans one and encoding the
    # whole text as one word (no pre-tokenizer, as Llama 2) gives the same pieces
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["\t", "\n", "\r", "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_corpus(seed=seed), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    data["pre_tokenizer"] = None
    learned = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])[len(SPECIAL_TOKENS):]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + [piece for piece, _ in learned]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update((piece, len(SPECIAL_TOKENS) + i) for i, piece in enumerate(pieces))
    data["model"]["vocab"] = vocab
    return Tokenizer.from_str(json.dumps(data))


def cached_tokenizer(vocab_size: int = 1024, seed: int = 0, *, pretokenizer: str = "gpt2") -> Path:
    """A trained tokenizer dir, trained once per (vocab_size, seed, pretokenizer, interpreter)."""
    key = {"tokenizer": vocab_size, "seed": seed, "pretokenizer": pretokenizer}

    def train(tmp: Path) -> None:
        train_tokenizer(tmp, vocab_size, seed, pretokenizer=pretokenizer)

    return _cached_dir(cache_root() / "tokenizers", key, train)


def build_model(
    out_dir: str | os.PathLike[str],
    *,
    family: str = "llama",
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    tokenizer: str | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a seeded random checkpoint plus tokenizer to `out_dir`; returns the dir.

    Without `tokenizer_dir`, a tokenizer of `vocab_size` entries is trained and cached,
    of the kind `tokenizer` names (a PRETOKENIZERS entry; by default the family's,
    `FAMILY_PRETOKENIZER`).
    """
    import torch
    import transformers

    _validate(family=family, hidden_size=hidden_size, num_heads=num_heads,
              num_kv_heads=num_kv_heads, dtype=dtype)
    if tokenizer_dir is None:
        tok_dir = cached_tokenizer(vocab_size, pretokenizer=tokenizer or FAMILY_PRETOKENIZER[family])
    else:
        tok_dir = Path(tokenizer_dir)
    tokenizer_vocab = _tokenizer_vocab_size(tok_dir)
    if tokenizer_vocab > vocab_size:
        raise ConfigError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens in {tok_dir}")
    special_ids = _special_token_ids(tok_dir)

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA[family], tie_word_embeddings=tie_word_embeddings,
        bos_token_id=special_ids[BOS_TOKEN], eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, num_layers=num_layers, seed=seed)
    model = model.to(getattr(torch, dtype))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()
    config_path = out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["rope_theta"] = ROPE_THETA[family]
    _write_json(config_path, config_json)

    shutil.copyfile(tok_dir / "tokenizer.json", out / "tokenizer.json")
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max_position_embeddings
    _write_json(out / "tokenizer_config.json", tok_config)
    return out


def normalize_spec(spec: Mapping[str, Any] | str) -> dict[str, Any]:
    """A full spec dict with defaults filled in; a string names a preset."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"unknown model preset {spec!r}; choose one of {sorted(PRESETS)}")
        spec = PRESETS[spec]
    unknown = sorted(set(spec) - set(_BUILD_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise ConfigError(f"unknown model spec keys {unknown}; valid keys: "
                          f"{list(_BUILD_KEYS + _OPTIONAL_KEYS)}")
    full = {**_SPEC_DEFAULTS, **spec}
    missing = [k for k in _BUILD_KEYS if k not in full]
    if missing:
        raise ConfigError(f"model spec lacks {missing}")
    _validate(family=full["family"], hidden_size=full["hidden_size"],
              num_heads=full["num_heads"], num_kv_heads=full["num_kv_heads"], dtype=full["dtype"])
    if full.get("tokenizer") not in (None, *PRETOKENIZERS):
        raise ConfigError(f"unknown tokenizer {full['tokenizer']!r}; choose one of "
                          f"{list(PRETOKENIZERS)}")
    optional = {k: full[k] for k in _OPTIONAL_KEYS if full.get(k) is not None}
    return {k: full[k] for k in _BUILD_KEYS} | optional


def spec_hash(spec: Mapping[str, Any] | str) -> str:
    """The cache key of a spec: equal for equal specs, whatever their key order."""
    return _hash({"model": normalize_spec(spec)})


def cached_model(spec: Mapping[str, Any] | str) -> Path:
    """The dir of a model built from `spec` (a dict or preset name), built on first use."""
    full = normalize_spec(spec)
    return _cached_dir(cache_root(), {"model": full}, lambda tmp: build_model(tmp, **full))


def parameter_count(spec: Mapping[str, Any] | str) -> int:
    """Number of distinct parameters of a spec's model (tied embeddings counted once)."""
    s = normalize_spec(spec)
    head_dim = s["hidden_size"] // s["num_heads"]
    hidden, kv_dim = s["hidden_size"], s["num_kv_heads"] * head_dim
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    if s["family"] == "qwen2":
        attention += hidden + 2 * kv_dim  # q/k/v biases
    if s["family"] == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm
    layer = attention + 3 * hidden * s["intermediate_size"] + 2 * hidden
    embeddings = s["vocab_size"] * hidden * (1 if s["tie_word_embeddings"] else 2)
    return s["num_layers"] * layer + embeddings + hidden


def _init_weights(model: Any, *, num_layers: int, seed: int) -> None:
    """Seeded init that makes every weight matter.

    HF's std 0.02 leaves attention nearly uniform (so a RoPE or mask bug barely moves
    the logits) and logits nearly tied; fan-in scaling gives O(1) attention scores,
    norm weights away from 1 and logits with a std of ~2.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(noise * (2.0 / math.sqrt(param.shape[1])))
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2 * num_layers)  # keep the residual stream's scale
                param.copy_(noise * std)


def _validate(*, family: str, hidden_size: int, num_heads: int, num_kv_heads: int,
              dtype: str) -> None:
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; choose one of {list(FAMILIES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    if hidden_size % num_heads:
        raise ConfigError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def _tokenizer_vocab_size(tok_dir: Path) -> int:
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
    return max(ids) + 1


def _special_token_ids(tok_dir: Path) -> dict[str, int]:
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    missing = [t for t in SPECIAL_TOKENS if t not in ids]
    if missing:
        raise ConfigError(f"tokenizer in {tok_dir} lacks special tokens {missing}")
    return ids


def _hash(key: Mapping[str, Any]) -> str:
    # The stdlib corpus (so the tokenizer) depends on the interpreter's version.
    full = {**key, "modelgen_version": MODELGEN_VERSION,
            "python": list(sys.version_info[:2])}
    blob = json.dumps(full, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def _cached_dir(parent: Path, key: Mapping[str, Any], build: Any) -> Path:
    """Build into a temp dir and rename it into place, so a half-built dir is never reused."""
    final = parent / _hash(key)
    if final.is_dir():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=parent))
    try:
        build(tmp)
        _write_json(tmp / "modelgen_spec.json", {**key, "modelgen_version": MODELGEN_VERSION})
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
