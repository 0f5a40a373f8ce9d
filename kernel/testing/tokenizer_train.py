"""The tokenizers of the test models: BPE (byte-level, or SentencePiece-style with byte
fallback) trained with `tokenizers` on the Python standard library's own source files,
deterministically, and the chat template that goes with them. `modelgen` builds models
around them; heavy imports happen inside the functions."""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unikern.errors import ConfigError

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

CORPUS_MAX_BYTES = 3_000_000
_CORPUS_MAX_FILE_BYTES = 200_000
# Test suites, data tables and the IDLE GUI are not representative Python source.
_CORPUS_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "idlelib", "encodings", "pydoc_data",
     "turtledemo", "__pycache__"}
)


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


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
