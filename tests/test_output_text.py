"""Streaming detokenization with stop strings: whole characters only, stop strings never
emitted even when they span tokens, held-back text released once it cannot be one; each
token's text is what it adds to the prompt's text when decoded after it."""

from __future__ import annotations

import pytest

from unikern.stages.output import TextStream


@pytest.fixture(scope="module")
def tok():
    from mlx_lm.utils import load_tokenizer

    from unikern.testing.modelgen import cached_model

    return load_tokenizer(cached_model("tiny-llama"))


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return ids


def feed(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[TextStream, list[str]]:
    """Add tokens one by one until the stream stops; the pieces it returned, in order."""
    stream = TextStream(tok.decode, stop)
    pieces = []
    for token_id in ids:
        pieces.append(stream.add(token_id))
        if stream.stopped:
            break
    return stream, pieces


@pytest.mark.parametrize("stop", [(), ("\n\n",), ("界 🙂!",)])
def test_multibyte_characters_are_never_split(tok, stop):
    text = "héllo 世界 🙂"
    ids = encode(tok, text)
    assert len(ids) > len(text)  # several tokens per character: byte-level pieces
    stream, pieces = feed(tok, ids, stop)
    assert not stream.stopped
    pieces.append(stream.finish())
    for piece in pieces:
        assert "\ufffd" not in piece
        assert piece.encode("utf-8").decode("utf-8") == piece
    assert "".join(pieces) == text
    # a character's bytes arrive over several tokens: those tokens emit nothing yet
    assert pieces.count("") >= 5
    # whatever is out at any moment is a prefix of the text
    for k in range(len(pieces)):
        assert text.startswith("".join(pieces[: k + 1]))


def test_stop_string_spanning_tokens_stops_and_is_not_emitted(tok):
    text = "Hello world. END here"
    ids = encode(tok, text)
    stream, pieces = feed(tok, ids, ("END",))
    assert stream.stopped
    assert len(pieces) == 11  # stopped on the "D" token: " E", "N", "D" made the stop string
    assert "".join(pieces) == "Hello world. "
    assert stream.finish() == ""
    assert stream.emitted_tokens == 11


def test_text_before_a_stop_string_is_emitted_as_it_comes(tok):
    text = "Hello world. END here"
    ids = encode(tok, text)
    stream = TextStream(tok.decode, ("END",))
    emitted = ""
    for k, token_id in enumerate(ids[:8]):  # up to "Hello world."
        emitted += stream.add(token_id)
        so_far = tok.decode(ids[: k + 1])
        assert so_far.startswith(emitted)
        # at most len("END") - 1 characters are held back
        assert len(emitted) >= len(so_far) - 2, (k, emitted, so_far)
    assert emitted.startswith("Hello worl")


def test_held_back_text_that_is_not_a_stop_string_is_emitted_later(tok):
    text = "Hello EN here and ENDING"
    ids = encode(tok, text)
    stream = TextStream(tok.decode, ("END",))
    emitted = "".join(stream.add(t) for t in ids[:6])  # "Hello EN"
    assert "Hello EN".startswith(emitted) and len(emitted) <= len("Hello ")  # "EN" may become "END"
    emitted += stream.add(ids[6])  # " he": it did not
    assert emitted.startswith("Hello EN")
    for token_id in ids[7:]:
        emitted += stream.add(token_id)
        if stream.stopped:
            break
    assert stream.stopped
    assert emitted == "Hello EN here and "


def test_first_stop_string_to_complete_stops_the_stream(tok):
    stream, pieces = feed(tok, encode(tok, "Hello world"), ("world", "llo"))
    assert stream.stopped and len(pieces) == 4  # stopped on "lo"
    assert "".join(pieces) == "He"


def test_stop_strings_completed_by_one_token_cut_at_the_earliest_start(tok):
    stream, pieces = feed(tok, encode(tok, "Hello world. END here"), ("END", "world. END"))
    assert stream.stopped and len(pieces) == 11  # both complete on "D"
    assert "".join(pieces) == "Hello "


def test_stop_string_of_multibyte_characters(tok):
    stream, pieces = feed(tok, encode(tok, "x 世界 y"), ("世界",))
    assert stream.stopped
    assert "".join(pieces) == "x "
    assert all("\ufffd" not in p for p in pieces)


def test_finish_flushes_held_back_text(tok):
    # " E" might have become "END"; at the end of the stream it is just text
    stream, pieces = feed(tok, encode(tok, "so E"), ("END",))
    assert not stream.stopped
    assert "".join(pieces) == "so"
    assert stream.finish() == " E"


def test_finish_flushes_an_incomplete_character_as_decode_does(tok):
    ids = encode(tok, "say hé")[:-1]  # the last byte of "é" never comes
    stream, pieces = feed(tok, ids)
    assert "".join(pieces) == "say h"
    assert stream.finish() == tok.decode(ids)[len("say h"):] == "\ufffd"


def test_a_stop_string_completed_by_the_final_flush_still_stops(tok):
    ids = encode(tok, "say hé")[:-1]
    stream, pieces = feed(tok, ids, ("h\ufffd",))
    assert not stream.stopped
    rest = stream.finish()
    assert stream.stopped
    assert "".join(pieces) + rest == "say "


def test_no_stop_strings_means_no_holdback(tok):
    text = "Hello world. END here"
    stream = TextStream(tok.decode, ())
    emitted = ""
    for k, token_id in enumerate(encode(tok, text)):
        emitted += stream.add(token_id)
        assert emitted == tok.decode(encode(tok, text)[: k + 1])
    assert stream.finish() == "" and not stream.stopped


# ---- text in the prompt's context ------------------------------------------------------

CONTINUATION = " exist é 🙂 wörld!"  # a leading space; é, 🙂 and ö span byte tokens


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-llama-spm"])
def any_tok(request):
    from mlx_lm.utils import load_tokenizer

    from unikern.testing.modelgen import cached_model

    return load_tokenizer(cached_model(request.param))


@pytest.mark.parametrize("stop", [(), ("never",)])
def test_each_token_adds_its_text_in_the_prompts_context(any_tok, stop):
    from unikern.messages import DETOKENIZE_CONTEXT

    tok = any_tok
    prompt = tok.encode("x = 1\nprint(")
    generated = tok.encode(CONTINUATION, add_special_tokens=False)
    assert len(generated) > len(CONTINUATION.split()) + 4  # several characters span tokens

    def in_context(n: int) -> str:
        return tok.decode(prompt + generated[:n])[len(tok.decode(prompt)):]

    expected = in_context(len(generated))
    assert expected.startswith(" ") and expected.endswith("é 🙂 wörld!")
    stream = TextStream(tok.decode, stop, tuple(prompt[-DETOKENIZE_CONTEXT:]))
    pieces = [stream.add(t) for t in generated]
    pieces.append(stream.finish())
    assert "".join(pieces) == expected
    if not stop:  # a character comes out with the token that completes it, never in parts
        for k in range(len(generated)):
            assert "".join(pieces[: k + 1]) == in_context(k + 1).rstrip("\ufffd"), k
    assert all("\ufffd" not in p for p in pieces)


def test_sentencepiece_drops_the_first_space_without_context():
    from mlx_lm.utils import load_tokenizer

    from unikern.testing.modelgen import cached_model

    tok = load_tokenizer(cached_model("tiny-llama-spm"))
    generated = tok.encode("exist here", add_special_tokens=False)  # '▁exist', '▁here'
    alone = TextStream(tok.decode, ())
    assert "".join(alone.add(t) for t in generated) == "exist here" == tok.decode(generated)
    after = TextStream(tok.decode, (), tuple(tok.encode("x")))
    assert "".join(after.add(t) for t in generated) == " exist here"


def test_the_fast_decoder_is_the_tokenizers_decode(any_tok):
    import random

    from unikern.stages.output import text_decoder

    decode = text_decoder(any_tok)
    assert decode != any_tok.decode  # the Rust tokenizer's own, for these stock tokenizers
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(any_tok)) for _ in range(rng.randrange(1, 8))]  # specials too
        assert decode(ids) == any_tok.decode(ids), ids


def test_the_fast_decoder_steps_aside_for_what_transformers_adds(any_tok, monkeypatch):
    from unikern.stages.output import text_decoder

    hf = any_tok.decode.__self__
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", True)
    assert text_decoder(any_tok) == any_tok.decode  # the clean-up is transformers'
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", False)
    assert text_decoder(any_tok) != any_tok.decode

    class OwnDecode(type(hf)):  # as a model's own tokenizer class might
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).replace("<n>", "\n")

    monkeypatch.setattr(hf, "__class__", OwnDecode)
    assert text_decoder(any_tok) == any_tok.decode
