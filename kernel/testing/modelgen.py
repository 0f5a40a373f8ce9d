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
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unikern.errors import ConfigError
from unikern.testing.tokenizer_train import (  # noqa: F401 (re-exported: tests and tools name them here)
    BOS_TOKEN,
    CHAT_TEMPLATE,
    CORPUS_MAX_BYTES,
    EOS_TOKEN,
    FAMILY_PRETOKENIZER,
    PAD_TOKEN,
    PRETOKENIZERS,
    QWEN2_SPLIT_REGEX,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    _write_json,
    stdlib_corpus,
    tokenizer_config,
    train_tokenizer,
)

# Bump when the output of train_tokenizer or build_model changes, so caches rebuild.
MODELGEN_VERSION = 3

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
# Real checkpoints of each family ship these; mlx-lm's llama and qwen2 read only the
# top-level `rope_theta`, so it is written there as well as under `rope_parameters`.
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}

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
