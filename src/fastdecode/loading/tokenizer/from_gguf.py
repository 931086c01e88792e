"""A GGUF file's tokenizer metadata -> a configured ``tokenizers.Tokenizer`` (+ the wrapper's options).

llama.cpp stores vocabulary, merges, scores and token types, not a ``tokenizer.json``, so the
normalizer / pre-tokenizer / decoder are rebuilt here. Vocabularies are large (Gemma 3: 262,144
tokens), so nothing here loops in Python bytecode over every token: per-token work goes through
``map`` over C functions, numpy, or the ``tokenizers`` constructors themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from ...errors import TokenizerError
from ..gguf_file import StringArray
from .cache import cached_backend
from .end_of_turn import END_OF_TURN_TOKENS, template_end_of_turn_ids
from .pretokenizers import BYTE_LEVEL_PRE_TOKENIZERS

# llama.cpp token types (``tokenizer.ggml.token_type``).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GPT-2's byte -> printable character table, as ``tokenizers``' ByteLevel pre-tokenizer applies it.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
_BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())

# Hashing vocabulary pieces (``_merges_from_scores``): an odd 64-bit base and a length mix.
_HASH_BASE = np.uint64(0x100000001B3)
_LENGTH_MIX = np.uint64(0x9E3779B97F4A7C15)
_MAX_CODE_POINTS = 1 << 24  # [V, L] code points held at once (64 MB, and 128 MB of hashes)


def gguf_tokenizer_parts(
    fields: Mapping[str, Any], source: str, gguf_path: Path | None = None
) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """(backend, keyword options of ``Tokenizer``) for the tokenizer a GGUF's metadata describes;
    ``gguf_path``: the file the fields come from, whose backend may be cached (``cache.py``)."""
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{source} has no tokenizer (no 'tokenizer.ggml.model' key)")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not _is_string_list(tokens) or not tokens:
        raise TokenizerError(f"{source}: 'tokenizer.ggml.tokens' is missing or not a list of strings")
    n = len(tokens)
    token_types = _int_array(fields, "tokenizer.ggml.token_type", n, source)
    if token_types is None:
        token_types = np.full(n, _TOKEN_NORMAL, dtype=np.int64)

    def token_id(key: str) -> int | None:
        value = fields.get(key)
        if value is None:
            return None
        try:
            value = int(value)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{source}: {key} is not an integer: {value!r}") from exc
        return value if 0 <= value < n else None

    bos = token_id("tokenizer.ggml.bos_token_id")
    eos = token_id("tokenizer.ggml.eos_token_id")
    unk = token_id("tokenizer.ggml.unknown_token_id")
    pad = token_id("tokenizer.ggml.padding_token_id")

    if model not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{source}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    default_add_bos = model == "llama"
    add_bos = _flag(fields.get("tokenizer.ggml.add_bos_token"), default_add_bos) and bos is not None
    add_eos = _flag(fields.get("tokenizer.ggml.add_eos_token"), False) and eos is not None

    def build() -> tokenizers.Tokenizer:
        spelled = list(tokens)  # (a StringArray: every string decoded now, once)
        if model == "gpt2":
            backend = _byte_level_bpe(fields, spelled, token_types, source)
        else:
            backend = _sentencepiece_bpe(fields, spelled, token_types, unk, source)
        special = set(np.flatnonzero(np.isin(token_types, (_TOKEN_CONTROL, _TOKEN_UNKNOWN))).tolist())
        special |= {i for i in (bos, eos, unk) if i is not None}
        user_defined = [i for i in np.flatnonzero(token_types == _TOKEN_USER_DEFINED).tolist() if i not in special]
        backend.add_special_tokens(
            [AddedToken(spelled[i], special=True, normalized=False) for i in sorted(special) if spelled[i]]
        )
        if user_defined:
            backend.add_tokens(
                [AddedToken(spelled[i], special=False, normalized=False) for i in user_defined if spelled[i]]
            )
        if add_bos or add_eos:
            backend.post_processor = _template_processor(
                (spelled[bos], bos) if add_bos else None, (spelled[eos], eos) if add_eos else None
            )
        return backend

    eot, eom = token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")
    special_ids = [i for i in (bos, eos, unk, pad, eot, eom) if i is not None]
    # what the wrapper asks of the backend while it is built, answered without reading a cached one
    backend = cached_backend(gguf_path, n, build, texts=END_OF_TURN_TOKENS, ids=special_ids)

    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template is not a string")
    eos_ids = [eos, eot, eom]
    eos_ids.extend(template_end_of_turn_ids(backend, template))
    options = dict(
        bos_token_id=bos,
        eos_token_ids=[i for i in eos_ids if i is not None],
        pad_token_id=pad,
        chat_template=template,
        add_bos_token=add_bos,
        unk_token=tokens[unk] if unk is not None else None,
    )
    return backend, options


def _byte_level_bpe(fields: Mapping[str, Any], tokens: Sequence[str], token_types: np.ndarray, source: str) -> Any:
    """GGUF "gpt2": GPT-2 style byte-level BPE; the split comes from ``tokenizer.ggml.pre``."""
    pre_name = fields.get("tokenizer.ggml.pre") or "default"
    factory = BYTE_LEVEL_PRE_TOKENIZERS.get(pre_name)
    if factory is None:
        raise TokenizerError(
            f"{source}: unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(sorted(BYTE_LEVEL_PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in fields:
        raise TokenizerError(f"{source}: byte-level BPE needs tokenizer.ggml.merges, which is missing")
    merges = _merge_pairs(fields["tokenizer.ggml.merges"], source)

    # Normal tokens are spelled in GPT-2's byte alphabet; a few converters store some as raw
    # UTF-8, which BPE could never produce, so respell those. Control / user-defined tokens are
    # raw text matched as added tokens and keep their spelling. One check over all the text
    # first: usually every character is in the alphabet and no token needs a look.
    if not _BYTE_ALPHABET.issuperset("".join(tokens)):
        keep = np.isin(token_types, (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)).tolist()
        tokens = [
            token if kept or _BYTE_ALPHABET.issuperset(token) else _byte_level_spelling(token)
            for token, kept in zip(tokens, keep)
        ]

    normalizer, pre_tokenizer, ignore_merges = factory()
    backend = tokenizers.Tokenizer(_bpe_model(source, _first_ids(tokens), merges, ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_spelling(text: str) -> str:
    """Raw text -> its bytes spelled in GPT-2's alphabet (one piece: the pre-tokenizer has no regex)."""
    return "".join(piece for piece, _ in _BYTE_LEVEL.pre_tokenize_str(text))


def _sentencepiece_bpe(
    fields: Mapping[str, Any], tokens: Sequence[str], token_types: np.ndarray, unk: int | None, source: str
) -> Any:
    """GGUF "llama": SentencePiece BPE as llama.cpp runs it.

    Spaces become "▁" and one "▁" is prepended to the text and to each stretch after a special
    token (``add_space_prefix``, llama.cpp's ``is_prev_special`` rule; the same as the Prepend +
    Replace normalizer of Llama's original ``tokenizer.json``). Characters missing from the
    vocabulary fall back to ``<0xNN>`` byte tokens. SentencePiece merges the adjacent pair whose
    result has the best score; as BPE ranks that is "merges sorted by score", derived from the
    vocabulary when the file lists no merges.
    """
    vocab = _first_ids(tokens)
    if "tokenizer.ggml.merges" in fields:
        merges = _merge_pairs(fields["tokenizer.ggml.merges"], source)
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if not isinstance(scores, (list, tuple)) or len(scores) != len(tokens):
            raise TokenizerError(f"{source}: SentencePiece vocabulary needs tokenizer.ggml.scores (one per token)")
        merges = _merges_from_scores(tokens, np.asarray(scores, dtype=np.float64), token_types, vocab)
    backend = tokenizers.Tokenizer(
        _bpe_model(
            source,
            vocab,
            merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = _flag(fields.get("tokenizer.ggml.add_space_prefix"), True)
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if add_space_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: Sequence[str], scores: np.ndarray, token_types: np.ndarray, vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, best token score first.

    Ranked by (-score of the token, its id, left piece id, right piece id). Gemma 3's vocabulary
    has about 1.1 million cut positions: looking up each piece as a new Python string costs about
    3 s of CPU, so pieces are found by hash instead, over the tokens as a [V, L] array of code
    points (rolling polynomial hashes, mod 2**64, and binary search in the sorted vocabulary's
    hashes); every pair found is then checked code point by code point. A vocabulary whose hashes
    collide, or too long to hold as an array, takes the plain lookups (``_merges_by_lookup``).
    """
    n = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    first = np.fromiter(map(vocab.__getitem__, tokens), dtype=np.int64, count=n) == np.arange(n)
    candidates = np.flatnonzero((token_types == _TOKEN_NORMAL) & (lengths >= 2) & first)
    max_len = int(lengths.max())
    if n * max_len > _MAX_CODE_POINTS:
        return _merges_by_lookup(tokens, scores, candidates, vocab)
    codes = np.array(tokens, dtype=f"<U{max_len}").view(np.uint32).reshape(n, max_len)  # [V, L], zero padded
    prefix = np.zeros((n, max_len + 1), dtype=np.uint64)  # prefix[:, k]: hash of token[:k]
    power = np.ones(max_len + 1, dtype=np.uint64)  # power[k] = BASE ** k
    with np.errstate(over="ignore"):
        for k in range(max_len):
            prefix[:, k + 1] = prefix[:, k] * _HASH_BASE + codes[:, k]
            power[k + 1] = power[k] * _HASH_BASE

        def key(hashes: np.ndarray, length: Any) -> np.ndarray:  # the hash of a piece, with its length mixed in
            return hashes ^ (np.asarray(length, dtype=np.uint64) * _LENGTH_MIX)

        vocab_ids = np.flatnonzero(first)
        vocab_keys = key(prefix[vocab_ids, lengths[vocab_ids]], lengths[vocab_ids])
        order = np.argsort(vocab_keys)
        sorted_keys, sorted_ids = vocab_keys[order], vocab_ids[order]
        if (sorted_keys[1:] == sorted_keys[:-1]).any():
            return _merges_by_lookup(tokens, scores, candidates, vocab)

        def lookup(keys: np.ndarray) -> np.ndarray:  # vocabulary id of each key, -1 where none
            at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
            return np.where(sorted_keys[at] == keys, sorted_ids[at], -1)

        found_token, found_left, found_right = [], [], []
        for cut in range(1, max_len):
            rows = candidates[lengths[candidates] > cut]
            size = lengths[rows]
            left = lookup(key(prefix[rows, cut], cut))
            right = lookup(key(prefix[rows, size] - prefix[rows, cut] * power[size - cut], size - cut))
            hit = (left >= 0) & (right >= 0)
            rows, left, right = rows[hit], left[hit], right[hit]
            # the exact check: equal lengths and code points (the zero padding compares equal too)
            exact = ((lengths[left] == cut) & (lengths[right] == lengths[rows] - cut)
                     & (codes[rows, :cut] == codes[left, :cut]).all(axis=1)
                     & (codes[rows, cut:] == codes[right, : max_len - cut]).all(axis=1))
            if not exact.all():
                return _merges_by_lookup(tokens, scores, candidates, vocab)
            found_token.append(rows)
            found_left.append(left)
            found_right.append(right)
    if not found_token:
        return []
    return _ranked(tokens, scores, *(np.concatenate(parts) for parts in (found_token, found_left, found_right)))


def _merges_by_lookup(
    tokens: Sequence[str], scores: np.ndarray, candidates: np.ndarray, vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """``_merges_from_scores`` with one dictionary lookup per piece (the plain way, for any vocabulary)."""
    found = [
        (index, left_id, right_id)
        for index in candidates.tolist()
        for cut in range(1, len(tokens[index]))
        if (left_id := vocab.get(tokens[index][:cut])) is not None
        and (right_id := vocab.get(tokens[index][cut:])) is not None
    ]
    if not found:
        return []
    return _ranked(tokens, scores, *np.array(found, dtype=np.int64).reshape(-1, 3).T)


def _ranked(tokens: Sequence[str], scores: np.ndarray, token: np.ndarray, left: np.ndarray,
            right: np.ndarray) -> list[tuple[str, str]]:
    """Merges (left piece, right piece) ranked by (-score of the token, its id, left id, right id)."""
    ranked = np.lexsort((right, left, token, -scores[token]))  # the last key sorts first
    piece = tokens.__getitem__
    return list(zip(map(piece, left[ranked].tolist()), map(piece, right[ranked].tolist())))


# --- helpers ---------------------------------------------------------------------------------
def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id of its first occurrence (a repeated spelling keeps the lowest id)."""
    n = len(tokens)
    return dict(zip(reversed(tokens), range(n - 1, -1, -1)))


def _flag(value: Any, default: bool) -> bool:
    return default if value is None else bool(value)


def _int_array(fields: Mapping[str, Any], key: str, n: int, source: str) -> np.ndarray | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise TokenizerError(f"{source}: {key} must be a list with one entry per token ({n})")
    return np.array(value, dtype=np.int64)


def _is_string_list(value: Any) -> bool:
    """A list of strings: a list or tuple of str, or a GGUF string array (``StringArray``: strings by type)."""
    return isinstance(value, StringArray) or isinstance(value, (list, tuple)) and not set(map(type, value)) - {str}


def _merge_pairs(merges: Any, source: str) -> list[tuple[str, str]]:
    if not _is_string_list(merges):
        raise TokenizerError(f"{source}: tokenizer.ggml.merges is not a list of strings")
    pairs = list(map(tuple, map(str.split, merges, repeat(" "))))
    if set(map(len, pairs)) - {2}:
        bad = next(pair for pair in pairs if len(pair) != 2)
        raise TokenizerError(f"{source}: malformed merge {' '.join(bad)!r} (want 'left right')")
    return pairs


def _bpe_model(source: str, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Any:
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as exc:  # e.g. a merge naming a token that is not in the vocabulary
        raise TokenizerError(f"{source}: invalid BPE vocabulary/merges: {exc}") from exc


def _template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
    """A post-processor adding BOS and/or EOS around each sequence (transformers' update_post_processor)."""
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))
