"""A cached GGUF tokenizer is read on first use (loading/tokenizer/cache.py's ``DeferredBackend``): the
wrapper built on it without reading it answers as the one built on the backend itself, and the first
other use reads it (or rebuilds a damaged entry). Oracle: the same GGUF's tokenizer built with no cache."""

from __future__ import annotations

import pickle

import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402

from fastdecode.loading.gguf_file import GGUFFile  # noqa: E402
from fastdecode.loading.tokenizer import Tokenizer, cache, from_gguf  # noqa: E402
from tiny_gguf import write_gguf  # noqa: E402

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TEXT = "in the sea, a 'résumé' <|im_start|> and <|im_end|>"


@pytest.fixture()
def cached(tmp_path, monkeypatch):
    """(load, built): ``load()`` makes the tokenizer of a tiny GGUF with a chat template through a fresh
    cache that counts the tiny vocabulary as large; ``built`` counts the backends built."""
    path = write_gguf(tmp_path / "llama-Q4_1.gguf", "llama-gqa", QT.Q4_1)
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "MIN_CACHED_VOCABULARY", 0)
    built = []
    real_build = from_gguf._byte_level_bpe
    monkeypatch.setattr(from_gguf, "_byte_level_bpe", lambda *args: built.append(1) or real_build(*args))
    fields = {**GGUFFile(path).metadata, "tokenizer.chat_template": TEMPLATE}
    return (lambda: Tokenizer.from_gguf_fields(fields, path=path)), built, path


def _answers(tokenizer: Tokenizer) -> tuple:
    return (tokenizer.vocab_size, tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.bos_token,
            tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token, tokenizer.add_bos_token)


def test_a_cached_tokenizer_is_read_on_first_use_and_answers_as_the_built_one(cached):
    load, built, _ = cached
    first = load()  # built, then saved with its facts
    assert len(built) == 1 and not isinstance(first.backend, cache.DeferredBackend)
    second = load()
    assert isinstance(second.backend, cache.DeferredBackend) and not second.backend.is_read
    assert _answers(second) == _answers(first) and not second.backend.is_read  # from the facts alone
    assert first.backend.token_to_id("<|im_end|>") in second.eos_token_ids  # the template's end of turn counted
    assert second.encode(TEXT) == first.encode(TEXT) and second.backend.is_read  # first other use reads it
    assert second.decode(second.encode(TEXT), skip_special_tokens=False) == first.decode(first.encode(TEXT), skip_special_tokens=False)
    assert second.special_token_ids == first.special_token_ids
    assert second.backend.to_str() == first.backend.to_str() and len(built) == 1
    copy = pickle.loads(pickle.dumps(load().backend))  # pickles as the backend it stands for
    assert copy.to_str() == first.backend.to_str()


def test_a_damaged_entry_is_rebuilt_on_first_use_and_missing_facts_read_at_once(cached):
    load, built, path = cached
    reference = load()
    cache.cache_file(path).write_text("{ damaged")
    deferred = load()
    assert isinstance(deferred.backend, cache.DeferredBackend) and len(built) == 1
    assert deferred.encode(TEXT) == reference.encode(TEXT) and len(built) == 2  # rebuilt, written again
    assert load().backend.to_str() == reference.backend.to_str() and len(built) == 2

    facts = cache.cache_file(path).with_name(cache.cache_file(path).stem + ".facts.json")
    facts.write_text('{"version": 0}')  # facts of another version: the entry is read at load, facts rewritten
    eager = load()
    assert not isinstance(eager.backend, cache.DeferredBackend) and _answers(eager) == _answers(reference)
    assert isinstance(load().backend, cache.DeferredBackend) and len(built) == 2


def test_a_cached_tokenizer_streams_split_characters_whole(cached):
    """The streaming detokenizer steps ``DecodeStream`` on the real backend, also when the tokenizer came
    from the cache: a character split over byte tokens comes out once complete, never as U+FFFD pieces
    (DecodeStream refused the stand-in, and every token went through the fallback that emits U+FFFD)."""
    from fastdecode.loading.tokenizer import IncrementalDetokenizer

    load, _, _ = cached
    reference, deferred = load(), load()
    assert isinstance(deferred.backend, cache.DeferredBackend)
    text = "résumé 日本 🤗 done"
    ids = reference.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2  # multi-byte characters really are split over tokens
    for tokenizer in (reference, deferred):
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.push(i) for i in ids] + [detokenizer.finish()]
        assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
