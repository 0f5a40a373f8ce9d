"""Built test models load through mlx-lm exactly like real checkpoints."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from unikern.errors import ConfigError
from unikern.testing import modelgen

TINY_PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama-spm"]
MULTIBYTE_TEXT = "héllo 世界 🙂"


@pytest.fixture(scope="module")
def tiny_llama_dir() -> Path:
    return modelgen.cached_model("tiny-llama")


@pytest.fixture(scope="module")
def tiny_llama_tokenizer(tiny_llama_dir: Path):
    return mlx_lm.tokenizer_utils.load(tiny_llama_dir)


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    modelgen.train_tokenizer(tmp_path, vocab_size=1024)
    cached = modelgen.cached_tokenizer(1024)  # trained separately, maybe by another process
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (cached / name).read_bytes(), name
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 1024


def test_special_tokens_have_fixed_ids_and_match_config(tiny_llama_dir: Path,
                                                       tiny_llama_tokenizer) -> None:
    tokenizer = tiny_llama_tokenizer
    ids = [tokenizer.convert_tokens_to_ids(t) for t in modelgen.SPECIAL_TOKENS]
    assert ids == list(range(len(modelgen.SPECIAL_TOKENS)))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.eos_token_ids == {tokenizer.eos_token_id}
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id


def test_multibyte_text_round_trips(tiny_llama_tokenizer) -> None:
    tokenizer = tiny_llama_tokenizer
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE_TEXT
    # Streaming decode one token at a time must not split a UTF-8 sequence.
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids[1:]:
        detokenizer.add_token(token)
        assert "\ufffd" not in detokenizer.text
    detokenizer.finalize()
    assert detokenizer.text == MULTIBYTE_TEXT


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_family_tokenizes_like_tokenizer_json(preset: str) -> None:
    # transformers rebuilds some families' tokenizers (Qwen2Tokenizer) around the vocab.
    from tokenizers import Tokenizer

    model_dir = modelgen.cached_model(preset)
    _, tokenizer = mlx_lm.load(str(model_dir))
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "def f(x):\n\treturn x**2 + 10_000  # naïve 世界 🙂\r\n"
    assert tokenizer.encode(text) == raw.encode(text).ids
    assert len(tokenizer.get_vocab()) == raw.get_vocab_size() == 1024


def test_sentencepiece_tokenizer_has_llamas_layout() -> None:
    tokenizer = mlx_lm.tokenizer_utils.load(modelgen.cached_model("tiny-llama-spm"))
    assert type(tokenizer._detokenizer).__name__ == "SPMStreamingDetokenizer"
    ids = tokenizer.encode("x é", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["▁x", "▁", "<0xC3>", "<0xA9>"]  # byte fallback
    assert tokenizer.convert_ids_to_tokens(list(range(6, 8))) == ["<0x00>", "<0x01>"]
    assert tokenizer.decode(ids) == "x é"  # the first space is stripped
    assert tokenizer.decode(tokenizer.encode(MULTIBYTE_TEXT), skip_special_tokens=True) == MULTIBYTE_TEXT
    # specs without the optional `tokenizer` key keep the hashes they had before it
    assert "tokenizer" not in modelgen.normalize_spec("tiny-llama")
    assert modelgen.spec_hash({**modelgen.PRESETS["tiny-llama"], "tokenizer": "spm"}) == \
        modelgen.spec_hash("tiny-llama-spm")


def test_chat_template_renders_roles_and_generation_prompt(tiny_llama_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Sum?"}]
    text = tiny_llama_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    assert text == ("<|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|>"
                    "<|assistant|>Hello<|eos|><|user|>Sum?<|eos|><|assistant|>")
    ids = tiny_llama_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tiny_llama_tokenizer.bos_token_id
    assert ids.count(tiny_llama_tokenizer.bos_token_id) == 1
    assert ids[-1] == tiny_llama_tokenizer.convert_tokens_to_ids("<|assistant|>")
    no_prompt = tiny_llama_tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert not no_prompt.endswith("<|assistant|>")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_preset_loads_with_mlx_lm_and_generates(preset: str) -> None:
    spec = modelgen.PRESETS[preset]
    model, tokenizer = mlx_lm.load(str(modelgen.cached_model(preset)))
    assert model.model_type == spec["family"]
    params = dict(tree_flatten(model.parameters()))
    assert sum(p.size for p in params.values()) == modelgen.parameter_count(preset)
    assert {p.dtype for p in params.values()} == {getattr(mx, spec["dtype"])}
    assert ("lm_head.weight" in params) != spec["tie_word_embeddings"]
    text = mlx_lm.generate(model, tokenizer, "def add(a, b):", max_tokens=8)
    assert isinstance(text, str) and text


def test_cached_model_is_reused_and_keyed_by_spec() -> None:
    spec = dict(modelgen.PRESETS["tiny-qwen3"])
    path = modelgen.cached_model(spec)
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns
    reordered = dict(reversed(list(spec.items())))
    assert modelgen.cached_model(reordered) == path
    assert modelgen.cached_model("tiny-qwen3") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert modelgen.spec_hash({**spec, "seed": 1}) != modelgen.spec_hash(spec)


def test_cache_root_override_builds_identical_files(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    reference = modelgen.cached_model("tiny-qwen3")
    monkeypatch.setenv("UNIKERN_MODEL_CACHE", str(tmp_path))
    # A leftover half-built dir from a killed build must not be mistaken for the model.
    (tmp_path / f".{reference.name}.leftover").mkdir()
    fresh = modelgen.cached_model("tiny-qwen3")
    assert fresh == tmp_path / reference.name
    names = sorted(p.name for p in reference.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    for name in names:
        assert (fresh / name).read_bytes() == (reference / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{reference.name}.")
                and p.name != f".{reference.name}.leftover"]


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    spec = {**modelgen.PRESETS["tiny-qwen3"], "seed": 7}
    tokenizer_dir = modelgen.cached_tokenizer(spec["vocab_size"])
    other = modelgen.build_model(tmp_path, **spec, tokenizer_dir=tokenizer_dir)
    reference = modelgen.cached_model("tiny-qwen3")
    a = mx.load(str(reference / "model.safetensors"))
    b = mx.load(str(other / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not mx.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({**modelgen.PRESETS["tiny-llama"], "family": "gpt9"}, "unknown model family"),
        ({**modelgen.PRESETS["tiny-llama"], "dtype": "int8"}, "unknown dtype"),
        ({**modelgen.PRESETS["tiny-llama"], "num_kv_heads": 3}, "not a multiple"),
        ({**modelgen.PRESETS["tiny-llama"], "layers": 3}, "unknown model spec keys"),
        ({**modelgen.PRESETS["tiny-llama"], "tokenizer": "wordpiece"}, "unknown tokenizer"),
        ("tiny-gpt", "unknown model preset"),
    ],
)
def test_bad_specs_raise_config_error(spec, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        full = modelgen.normalize_spec(spec)
        modelgen.build_model(tmp_path, **full)


def test_vocab_smaller_than_tokenizer_is_rejected(tmp_path: Path) -> None:
    spec = {**modelgen.normalize_spec("tiny-llama"), "vocab_size": 512}
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        modelgen.build_model(tmp_path, **spec, tokenizer_dir=modelgen.cached_tokenizer(1024))


def test_presets_have_their_advertised_sizes() -> None:
    assert 0.9e6 < modelgen.parameter_count("tiny-llama") < 1.2e6
    assert 4.5e6 < modelgen.parameter_count("llama-5m") < 5.5e6
    assert 75e6 < modelgen.parameter_count("llama-80m") < 85e6


def test_default_model_is_small_and_writes_python() -> None:
    path = Path(str(resources.files("unikern.assets") / "default_model"))
    assert (path / "model.safetensors").stat().st_size < 12_000_000
    model, tokenizer = mlx_lm.load(str(path))
    assert model.model_type == "llama"
    text = mlx_lm.generate(model, tokenizer, "def add(a, b):", max_tokens=40)
    assert "\n" in text and any(word in text for word in ("return", "self", "if ", " = "))
