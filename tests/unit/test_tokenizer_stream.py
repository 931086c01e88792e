"""SentencePiece GGUF tokenizers and streaming detokenization (``IncrementalDetokenizer``).

Oracles: a small reference implementation of llama.cpp's SentencePiece BPE for the "llama" GGUF
path (there is no SentencePiece GGUF in the environment to compare against), and
``Tokenizer.decode`` for the streamed text.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import decoders

from fastdecode.loading.tokenizer import IncrementalDetokenizer, Tokenizer


# --- GGUF "llama" (SentencePiece BPE) vs a reference of llama.cpp's algorithm ----------------------
# fmt: off
SPM_PIECES = [
    # (piece, score): higher score merges first
    ("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("d", -2.0), ("e", -2.0), ("h", -2.0), ("l", -2.0),
    ("o", -2.0), ("r", -2.0), ("w", -2.0), ("é", -2.0), ("t", -2.0),
    ("ll", -3.0), ("he", -4.0), ("▁h", -5.0), ("llo", -6.0), ("▁he", -7.0), ("▁hello", -8.0),
    ("▁w", -9.0), ("or", -10.0), ("▁wor", -11.0), ("ld", -12.0), ("▁world", -13.0),
    ("ab", -14.0), ("▁a", -15.0), ("bc", -16.0), ("abc", -17.0), ("▁abc", -18.0), ("▁▁", -19.0),
    ("▁é", -20.0), ("ét", -21.0), ("▁ét", -22.0),
]
# fmt: on


def _spm_fields(**overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, score in SPM_PIECES:
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    tokens += ["<|user|>", "<tool>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}",
    }
    fields.update(overrides)
    return fields


def _reference_spm(fields: dict, text: str, add_bos: bool = True) -> list[int]:
    """llama.cpp's llm_tokenizer_spm, simplified: split out special/user-defined tokens, prefix a
    space to the text and after every such token, then repeatedly merge the adjacent pair whose
    concatenation is the best-scoring normal token (leftmost on ties); leftover symbols that are
    not tokens become <0xNN> byte tokens."""
    tokens, types, scores = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    vocab = {t: i for i, t in enumerate(tokens)}
    whole = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    out = [1] if add_bos else []
    fragments: list[tuple[bool, str]] = []
    rest = text
    while rest:
        hits = [(rest.find(t), -len(t), t) for t in whole if t in rest]
        if not hits:
            fragments.append((False, rest))
            break
        pos, _, token = min(hits)
        if pos:
            fragments.append((False, rest[:pos]))
        fragments.append((True, token))
        rest = rest[pos + len(token) :]
    prev_special = True
    for special, fragment in fragments:
        if special:
            out.append(vocab[fragment])
            prev_special = True
            continue
        text_piece = ((" " if prev_special else "") + fragment).replace(" ", "▁")
        prev_special = False
        symbols = list(text_piece)
        while True:
            best = None
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                idx = vocab.get(merged)
                if idx is not None and types[idx] == 1 and (best is None or scores[idx] > best[0]):
                    best = (scores[idx], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for symbol in symbols:
            if symbol in vocab:
                out.append(vocab[symbol])
            else:
                out.extend(vocab[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
    return out


SPM_TEXTS = [
    "hello world",
    "hello  world",
    " hello",
    "abc abcd",
    "été",
    "hello 日本 zz",
    "a<|user|>b",
    "<|user|>hello</s>",
    "x<tool>hello",
    "",
    "bc",
]


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_gguf_fields(_spm_fields())


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_encode_matches_reference(spm: Tokenizer, text: str) -> None:
    fields = _spm_fields()
    assert spm.encode(text) == _reference_spm(fields, text)
    assert spm.encode(text, add_special_tokens=False) == _reference_spm(fields, text, add_bos=False)


@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if "<" not in t])
def test_spm_decode_round_trip(spm: Tokenizer, text: str) -> None:
    assert spm.decode(spm.encode(text)) == text


def test_spm_specials_and_flags(spm: Tokenizer) -> None:
    assert spm.add_bos_token is True and spm.bos_token_id == 1 and spm.eos_token_ids == [2]
    ids = spm.encode("<|user|>hi<tool>")
    assert spm.decode(ids) == "hi<tool>"  # control skipped, user-defined kept (as llama.cpp)
    assert spm.apply_chat_template([{"role": "user", "content": "hey"}]) == "<|user|>hey</s>"
    no_bos = Tokenizer.from_gguf_fields(_spm_fields(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.add_bos_token is False and no_bos.encode("hello")[0] != 1
    no_prefix = Tokenizer.from_gguf_fields(_spm_fields(**{"tokenizer.ggml.add_space_prefix": False}))
    pieces = [no_prefix.backend.id_to_token(i) for i in no_prefix.encode("hello world", add_special_tokens=False)]
    assert pieces == ["he", "llo", "▁world"]  # no "▁" in front of the first word
    assert no_prefix.decode(no_prefix.encode(" hello world")) == " hello world"


# --- IncrementalDetokenizer ------------------------------------------------------------------
STREAM_TEXTS = [
    "héllo 世界 🤗 and more text",
    "Emoji: 👩\u200d👩\u200d👧 🇫🇷 😀😃😄 done",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "plain ascii, nothing special here.",
    "mixed: café ñ 12345 ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "   spaces   and\n\nnewlines\t",
]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_concatenates_to_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    detok = IncrementalDetokenizer(smol)
    pieces = _stream(detok, ids)
    assert "".join(pieces) == detok.text == smol.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never a broken character
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces[:-1]  # some multi-byte characters really were split over tokens


def test_token_bytes_join_into_the_text(smol: Tokenizer, spm: Tokenizer) -> None:
    """Byte-level BPE and SentencePiece byte fallback: each token's bytes, even where the token is part of
    a character (decoding it alone gives U+FFFD), join into the text's UTF-8."""
    for tokenizer, texts in ((smol, STREAM_TEXTS), (spm, ["hello 日本 zz", "été hello", "abc 🤗"])):
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert b"".join(tokenizer.token_bytes(i) for i in ids).decode("utf-8").strip() == text.strip()
        partial = [i for i in tokenizer.encode(texts[0], add_special_tokens=False) if "\ufffd" in tokenizer.decode([i])]
        assert partial and all(len(tokenizer.token_bytes(i)) >= 1 for i in partial)


def test_stream_with_prompt_and_special_tokens(smol: Tokenizer) -> None:
    prompt = smol.encode(smol.apply_chat_template([{"role": "user", "content": "Say hi in Japanese"}]))
    generated = smol.encode("こんにちは 👋<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(smol, prompt_ids=prompt, skip_special_tokens=skip)
        pieces = _stream(detok, generated)
        assert "".join(pieces) == smol.decode(generated, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_stream_flushes_incomplete_tail(smol: Tokenizer) -> None:
    ids = smol.encode("ok 🤗")
    truncated = ids[:-1]  # the emoji's last byte token is missing
    detok = IncrementalDetokenizer(smol)
    pieces = [detok.push(i) for i in truncated]
    assert "\ufffd" not in "".join(pieces)
    tail = detok.finish()
    assert tail.endswith("\ufffd")
    assert detok.text == smol.decode(truncated)
    assert detok.finish() == ""


def test_stream_decodes_a_bounded_window(smol: Tokenizer) -> None:
    """Each push decodes a few tokens, not the whole history."""
    calls: list[int] = []

    class CountingDecoder:  # every decode goes through the backend's decoder: DecodeStream's (Rust) and ours
        def decode_chain(self, tokens: list[str]) -> list[str]:
            calls.append(len(tokens))
            return [inner.decode(tokens)]

    backend = type(smol.backend).from_str(smol.backend.to_str())
    inner = backend.decoder
    backend.decoder = decoders.Decoder.custom(CountingDecoder())
    spy = Tokenizer(backend, eos_token_ids=smol.eos_token_ids)
    text = " ".join(STREAM_TEXTS) * 5
    ids = spy.encode(text)
    detok = IncrementalDetokenizer(spy)
    assert "".join(_stream(detok, ids)) == text
    assert len(ids) > 300 and max(calls) <= 8


def test_stream_spm_byte_fallback_and_space_strip(spm: Tokenizer) -> None:
    for text in ("hello 日本 zz", "été hello", " hello world", "abc 🤗"):
        ids = spm.encode(text)
        for skip in (True, False):
            detok = IncrementalDetokenizer(spm, skip_special_tokens=skip)
            pieces = _stream(detok, ids)
            assert "".join(pieces) == spm.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces)
    # With a prompt as context, the first generated word keeps its leading space (continuation).
    prompt, generated = spm.encode("hello"), spm.encode("world", add_special_tokens=False)
    detok = IncrementalDetokenizer(spm, prompt_ids=prompt)
    assert "".join(_stream(detok, generated)) == " world"


def test_stream_fuzz_byte_level(smol: Tokenizer) -> None:
    """Any id sequence, including invalid UTF-8 byte runs and special tokens, streams exactly."""
    rng = random.Random(0)
    single_byte = [i for i in range(smol.vocab_size) if len(smol.backend.id_to_token(i)) == 1]
    for _ in range(300):
        ids = [rng.choice(single_byte) if rng.random() < 0.6 else rng.randrange(smol.vocab_size) for _ in range(20)]
        for skip in (True, False):
            detok = IncrementalDetokenizer(smol, skip_special_tokens=skip)
            assert "".join(_stream(detok, ids)) == smol.decode(ids, skip_special_tokens=skip)


def test_stream_fuzz_spm(spm: Tokenizer) -> None:
    """SentencePiece: random pieces, specials, and valid <0xNN> runs stream exactly, never broken."""
    rng = random.Random(1)
    pieces_ids = [i for i in range(spm.vocab_size) if not spm.backend.id_to_token(i).startswith("<0x")]
    chars = "日本é🤗ñ\x01 a"
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 15)):
            if rng.random() < 0.4:
                ids += [spm.token_to_id(f"<0x{b:02X}>") for b in rng.choice(chars).encode()]
            else:
                ids.append(rng.choice(pieces_ids))
        for skip in (True, False):
            detok = IncrementalDetokenizer(spm, skip_special_tokens=skip)
            pieces = _stream(detok, ids)
            assert "".join(pieces) == spm.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces)
