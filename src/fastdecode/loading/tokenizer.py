"""Text <-> token ids, chat templates and streaming detokenization.

The BPE work itself is done by the Rust ``tokenizers`` library; this module only decides how to
*configure* it for each source a model can come from:

* a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json`` + generation config),
* a GGUF file's metadata (llama.cpp stores vocabulary, merges and token types, not a
  ``tokenizer.json``, so the normalizer / pre-tokenizer / decoder are rebuilt here),
* an in-memory ``transformers`` fast tokenizer (duck-typed).

``transformers`` is never imported here: it is heavy (seconds) and optional at runtime. Chat
templates are rendered with ``jinja2`` in the same sandbox configuration ``transformers`` uses, so
prompts are byte-identical to ``apply_chat_template(tokenize=False)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import TokenizerError
from .jsonfile import read_json_object

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# llama.cpp token types (``tokenizer.ggml.token_type``).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Tokens that end an assistant turn in common chat formats. They count as end-of-generation ids
# when the chat template writes them (the model learned to emit them where the template does),
# even if the config's single ``eos_token_id`` names another token.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)

# --- pre-tokenizer regexes -------------------------------------------------------------------
# A byte-level BPE vocabulary is only reproduced if text is cut into words exactly the way the
# merges were learned. GGUF names that split with ``tokenizer.ggml.pre``; each entry below is the
# split of the model's original ``tokenizer.json`` (which llama.cpp's ``llm_tokenizer_bpe`` regex
# list in llama-vocab.cpp mirrors).

# GPT-2's pattern, built into ``pre_tokenizers.ByteLevel(use_regex=True)``.
# Llama 3 (tiktoken cl100k style): case-insensitive contractions, numbers in groups of 1-3.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: like Llama 3 but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> tuple[Any, Any, bool]:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _digits_gpt2_pre() -> tuple[Any, Any, bool]:
    # StarCoder / SmolLM: every digit is its own word, then the GPT-2 split.
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return None, pre, False


def _llama3_pre() -> tuple[Any, Any, bool]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Llama 3's tokenizer.json sets ignore_merges (a word that is itself a token is not re-merged);
    # llama.cpp sets the same flag for this pre-tokenizer.
    return None, pre, True


def _qwen2_pre() -> tuple[Any, Any, bool]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Qwen2's tokenizer.json normalizes to NFC first.
    return normalizers.NFC(), pre, False


# tokenizer.ggml.pre -> factory returning (normalizer, pre_tokenizer, ignore_merges).
# "default" (and a missing key) means GPT-2's split, as in transformers' GGUF converter; llama.cpp's
# own "default" BPE split is a legacy approximation of the same thing.
_BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "gpt-2": _gpt2_pre,  # the name convert_hf_to_gguf.py writes for GPT-2
    "phi-2": _gpt2_pre,
    "mpt": _gpt2_pre,
    "olmo": _gpt2_pre,
    "smollm": _digits_gpt2_pre,
    "starcoder": _digits_gpt2_pre,
    "refact": _digits_gpt2_pre,
    "command-r": _digits_gpt2_pre,
    "codeshell": _digits_gpt2_pre,
    "llama3": _llama3_pre,
    "llama-v3": _llama3_pre,
    "llama-bpe": _llama3_pre,
    "falcon3": _llama3_pre,
    "pixtral": _llama3_pre,
    "dbrx": _llama3_pre,
    "smaug-bpe": _llama3_pre,
    "qwen2": _qwen2_pre,
    "deepseek-r1-qwen": _qwen2_pre,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    table: dict[int, str] = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TABLE = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_TABLE.values())


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` plus special ids and an optional chat template.

    ``encode``/``decode`` delegate to the Rust backend unchanged, so whatever the backend's
    post-processor does (e.g. prepend BOS) is what ``encode(add_special_tokens=True)`` does;
    ``add_bos_token`` reports it.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ) -> None:
        self.backend = backend
        # Padding / truncation configured in a tokenizer.json would silently change encode().
        backend.no_padding()
        backend.no_truncation()
        size = backend.get_vocab_size(with_added_tokens=True)

        def valid(token_id: Any) -> int | None:
            if token_id is None:
                return None
            token_id = int(token_id)
            return token_id if 0 <= token_id < size else None

        self.bos_token_id = valid(bos_token_id)
        self.pad_token_id = valid(pad_token_id)
        eos: list[int] = []
        for token_id in eos_token_ids:
            token_id = valid(token_id)
            if token_id is not None and token_id not in eos:
                eos.append(token_id)
        self.eos_token_ids = eos
        self.chat_template = chat_template
        if add_bos_token is None:
            add_bos_token = _post_processor_adds_bos(backend, self.bos_token_id)
        self.add_bos_token = bool(add_bos_token)

        # Strings handed to chat templates (``bos_token``, ``eos_token``...).
        self.bos_token = bos_token if bos_token is not None else self._id_to_token(self.bos_token_id)
        self.eos_token = eos_token if eos_token is not None else self._id_to_token(eos[0] if eos else None)
        self.pad_token = pad_token if pad_token is not None else self._id_to_token(self.pad_token_id)
        self.unk_token = unk_token
        self._compiled_template: Any = None
        self._special_ids: frozenset[int] | None = None

    # --- basic operations --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special added tokens: the ones ``decode(skip_special_tokens=True)`` drops."""
        if self._special_ids is None:
            self._special_ids = frozenset(
                token_id for token_id, token in self.backend.get_added_tokens_decoder().items() if token.special
            )
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            if not isinstance(text, str):
                raise TokenizerError(f"encode_batch() needs a list of str, got a {type(text).__name__}")
        return [enc.ids for enc in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The Rust binding wants Python ints: convert numpy arrays / torch tensors in one call.
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
            f"pad={self.pad_token_id}, add_bos={self.add_bos_token}, chat_template={self.chat_template is not None})"
        )

    # --- chat template -------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` to a prompt string, like ``transformers``' ``apply_chat_template(tokenize=False)``.

        Extra keyword arguments (``tools``, ``documents``, ``enable_thinking``...) are passed to the
        template as variables, as ``transformers`` does.
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; pass a plain prompt instead of messages")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
            raise TokenizerError("chat messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(self, name)
            if value is not None:
                variables[name] = value
        variables.update(kwargs)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled_template.render(**variables)
        except TokenizerError:
            raise
        except Exception as exc:  # jinja2 errors, or a template doing something invalid with the data
            raise TokenizerError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc

    # --- constructors --------------------------------------------------------------------------
    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ optional configs) from a Hugging Face model folder.

        Mirrors what ``transformers`` (v5) ``AutoTokenizer.from_pretrained`` produces: the named
        special tokens of ``tokenizer_config.json`` are made special (added if missing), and
        ``chat_template.jinja`` beats the template in ``tokenizer_config.json``. Whether BOS is
        prepended is decided by ``tokenizer.json``'s post-processor alone: transformers v5 drops
        ``add_bos_token``/``add_eos_token`` from the config whenever a ``tokenizer.json`` exists,
        and so do we. End-of-generation ids are gathered from the tokenizer,
        ``generation_config.json`` and ``config.json``.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist or is not a directory")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {folder} (only fast/tokenizers-format tokenizers are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception for any parse error
            raise TokenizerError(f"cannot read tokenizer {tokenizer_file}: {exc}") from exc

        config = _read_json(folder / "tokenizer_config.json")
        template = _select_chat_template(config.get("chat_template"), folder / "tokenizer_config.json")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read chat template {jinja_file}: {exc}") from exc

        names = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            names[name] = _token_content(config.get(name), name, folder / "tokenizer_config.json")
        # transformers registers the named tokens as special (adding them if the vocabulary lacks them),
        # so decode(skip_special_tokens=True) drops them.
        existing = backend.get_added_tokens_decoder()
        special_contents = {tok.content for tok in existing.values() if tok.special}
        to_add = [
            AddedToken(content, special=True, normalized=False)
            for content in dict.fromkeys(v for v in names.values() if v)
            if content not in special_contents
        ]
        if to_add:
            backend.add_special_tokens(to_add)
        ids = {name: (backend.token_to_id(v) if v else None) for name, v in names.items()}

        eos_ids: list[Any] = [ids["eos_token"]]
        for extra in ("generation_config.json", "config.json"):
            value = _read_json(folder / extra).get("eos_token_id")
            eos_ids.extend(value if isinstance(value, list) else [value])
        eos_ids.extend(_template_end_of_turn_ids(backend, template))
        return cls(
            backend,
            bos_token_id=ids["bos_token"],
            eos_token_ids=[i for i in eos_ids if isinstance(i, int)],
            pad_token_id=ids["pad_token"],
            chat_template=template,
            bos_token=names["bos_token"],
            eos_token=names["eos_token"],
            pad_token=names["pad_token"],
            unk_token=names["unk_token"],
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str = "GGUF metadata") -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes from its metadata (key -> plain Python value).

        ``tokenizer.ggml.model`` picks the algorithm: ``"gpt2"`` is byte-level BPE with the word
        split named by ``tokenizer.ggml.pre``; ``"llama"`` is SentencePiece-style BPE (scores,
        ``<0xNN>`` byte fallback, spaces as "▁"). Control tokens (type 3) and the unknown token
        become special added tokens (matched whole, dropped by ``decode(skip_special_tokens=True)``);
        user-defined tokens (type 4) are matched whole but kept on decode, as llama.cpp and
        transformers do. ``source`` (e.g. the file path) is used in error messages.
        """
        model = fields.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{source} has no tokenizer (no 'tokenizer.ggml.model' key)")
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{source}: 'tokenizer.ggml.tokens' is missing or not a list of strings")
        n = len(tokens)
        token_types = _int_list(fields, "tokenizer.ggml.token_type", n, source)
        if token_types is None:
            token_types = [_TOKEN_NORMAL] * n

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

        if model == "gpt2":
            backend = _byte_level_bpe(fields, tokens, token_types, source)
            default_add_bos = False
        elif model == "llama":
            backend = _sentencepiece_bpe(fields, tokens, token_types, unk, source)
            default_add_bos = True
        else:
            raise TokenizerError(
                f"{source}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )

        special = {i for i, kind in enumerate(token_types) if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)}
        special |= {i for i in (bos, eos, unk) if i is not None}
        user_defined = [i for i, kind in enumerate(token_types) if kind == _TOKEN_USER_DEFINED and i not in special]
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special) if tokens[i]]
        )
        if user_defined:
            backend.add_tokens(
                [AddedToken(tokens[i], special=False, normalized=False) for i in user_defined if tokens[i]]
            )

        add_bos = _flag(fields.get("tokenizer.ggml.add_bos_token"), default_add_bos) and bos is not None
        add_eos = _flag(fields.get("tokenizer.ggml.add_eos_token"), False) and eos is not None
        if add_bos or add_eos:
            backend.post_processor = _template_processor(
                (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
            )

        template = fields.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{source}: tokenizer.chat_template is not a string")
        eos_ids = [eos, token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")]
        eos_ids.extend(_template_end_of_turn_ids(backend, template))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in eos_ids if i is not None],
            pad_token_id=pad,
            chat_template=template,
            add_bos_token=add_bos,
            unk_token=tokens[unk] if unk is not None else None,
        )

    @classmethod
    def from_hf_tokenizer(cls, hf_tokenizer: Any) -> Tokenizer:
        """Wrap an in-memory ``transformers`` fast tokenizer (duck-typed: needs ``backend_tokenizer``).

        The backend is copied (through its JSON form) so that later changes transformers makes to
        its own object (padding, truncation) do not leak into ours.
        """
        source = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(source, tokenizers.Tokenizer):
            raise TokenizerError(
                f"{type(hf_tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; "
                "pass a PreTrainedTokenizerFast or a model folder with tokenizer.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_str(source.to_str())
        except Exception as exc:
            raise TokenizerError(f"cannot copy the tokenizer's backend: {exc}") from exc
        template = getattr(hf_tokenizer, "chat_template", None)
        template = _select_chat_template(template, f"{type(hf_tokenizer).__name__}.chat_template")

        def attr(name: str) -> Any:
            value = getattr(hf_tokenizer, name, None)
            return value if isinstance(value, (int, str)) else None

        eos = attr("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else []
        eos_ids.extend(_template_end_of_turn_ids(backend, template))
        return cls(
            backend,
            bos_token_id=attr("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=attr("pad_token_id"),
            chat_template=template,
            bos_token=attr("bos_token"),
            eos_token=attr("eos_token"),
            pad_token=attr("pad_token"),
            unk_token=attr("unk_token"),
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces for streaming.

    Byte-level and byte-fallback tokens can split one character over several tokens, and some
    decoders depend on neighbours (SentencePiece drops the space of the *first* token only), so a
    token cannot be decoded alone. Like vLLM's ``detokenize_incrementally`` we decode a short
    window: ``decode(ids[prefix:read])`` is the text already emitted for the window and
    ``decode(ids[prefix:])`` the text with the new tokens; the difference is the new piece. It is
    held back while it ends in U+FFFD (an incomplete UTF-8 sequence) and the window then slides
    forward, so each step costs a couple of decodes of a few tokens, not of the whole history.

    Skipped special tokens are left out of the window entirely: they decode to nothing, and
    starting a window at one would hide the real first token from SentencePiece's space strip.

    Without ``prompt_ids`` the pieces concatenate to exactly ``tokenizer.decode(pushed_ids)``
    (after ``finish()``). With ``prompt_ids`` the prompt's last tokens are context, so the pieces
    are the continuation as it reads after the prompt (e.g. a SentencePiece model's first
    generated word keeps its leading space); for byte-level BPE that is the same string.

    One case cannot be streamed exactly: ``tokenizers``' ByteFallback decoder turns a run of
    ``<0xNN>`` tokens that is not valid UTF-8 into one U+FFFD *per token*, retroactively, so a
    valid byte already emitted (say ``<0x39>`` = "9") becomes U+FFFD in ``decode(all)`` once an
    invalid byte follows it. Text the tokenizer itself produced never contains such runs, and
    byte-level BPE (GPT-2 style) decodes every sequence locally, so the stream is exact there.
    """

    _CONTEXT_TOKENS = 5  # prompt tokens kept as left context (vLLM uses the same number)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._hidden = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        ids = [int(i) for i in prompt_ids]
        ids = [i for i in ids if i not in self._hidden]
        # The window: left context (already emitted, or prompt) followed by held-back tokens.
        self._ids = ids[-self._CONTEXT_TOKENS :]
        self._read = len(self._ids)  # window tokens before this index are context
        self._prefix_text = self._decode(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _advance(self, new_text: str) -> str:
        piece = new_text[len(self._prefix_text) :]
        # Slide: the tokens just emitted become the left context of the next window.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text += piece
        return piece

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ('' while held back)."""
        token_id = int(token_id)
        if token_id in self._hidden:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            return self._advance(new_text)
        return ""

    def finish(self) -> str:
        """Flush whatever is held back (an incomplete character at the end decodes as U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._advance(new_text)


# --- helpers ---------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON config: {} when absent, TokenizerError when present but unreadable."""
    if not path.is_file():
        return {}
    return read_json_object(path, "tokenizer file", TokenizerError)


def _select_chat_template(value: Any, where: Any) -> str | None:
    """A template is a string, or a list of {name, template} / a dict name -> template: take 'default'."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        try:
            value = {entry["name"]: entry["template"] for entry in value}
        except (TypeError, KeyError) as exc:
            raise TokenizerError(f"{where}: chat_template list entries need 'name' and 'template'") from exc
    if isinstance(value, dict):
        template = value.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{where}: the 'default' chat template is not a string")
        return template
    raise TokenizerError(f"{where}: chat_template has unexpected type {type(value).__name__}")


def _token_content(value: Any, name: str, where: Path) -> str | None:
    """bos_token & co. are a string or a serialized AddedToken dict with 'content'."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise TokenizerError(f"{where}: {name} should be a string or a dict with 'content', got {value!r}")


def _template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
    """A post-processor adding BOS and/or EOS around each sequence (transformers' update_post_processor)."""
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether the backend's post-processor prepends BOS: ask it, whatever kind it is."""
    if bos_id is None or backend.post_processor is None:
        return False
    ids = backend.encode("", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _template_end_of_turn_ids(backend: tokenizers.Tokenizer, template: str | None) -> list[int]:
    """Known end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``...) that the chat template writes."""
    if not template:
        return []
    found = []
    for text in _END_OF_TURN_TOKENS:
        if text in template:
            token_id = backend.token_to_id(text)
            if token_id is not None:
                found.append(token_id)
    return found


def _flag(value: Any, default: bool) -> bool:
    return default if value is None else bool(value)


def _int_list(fields: Mapping[str, Any], key: str, n: int, source: str) -> list[int] | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise TokenizerError(f"{source}: {key} must be a list with one entry per token ({n})")
    return [int(v) for v in value]


def _merge_pairs(merges: Any, source: str) -> list[tuple[str, str]]:
    if not isinstance(merges, (list, tuple)):
        raise TokenizerError(f"{source}: tokenizer.ggml.merges is not a list of strings")
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
    except AttributeError as exc:
        raise TokenizerError(f"{source}: tokenizer.ggml.merges is not a list of strings") from exc
    for pair in pairs:
        if len(pair) != 2:
            raise TokenizerError(f"{source}: malformed merge {' '.join(pair)!r} (want 'left right')")
    return pairs  # type: ignore[return-value]


def _bpe_model(source: str, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Any:
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as exc:  # e.g. a merge naming a token that is not in the vocabulary
        raise TokenizerError(f"{source}: invalid BPE vocabulary/merges: {exc}") from exc


def _byte_level_bpe(fields: Mapping[str, Any], tokens: list[str], token_types: list[int], source: str) -> Any:
    """GGUF "gpt2": GPT-2 style byte-level BPE; the split comes from ``tokenizer.ggml.pre``."""
    pre_name = fields.get("tokenizer.ggml.pre") or "default"
    factory = _BYTE_LEVEL_PRE_TOKENIZERS.get(pre_name)
    if factory is None:
        raise TokenizerError(
            f"{source}: unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
            f"supported: {', '.join(sorted(_BYTE_LEVEL_PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in fields:
        raise TokenizerError(f"{source}: byte-level BPE needs tokenizer.ggml.merges, which is missing")
    merges = _merge_pairs(fields["tokenizer.ggml.merges"], source)

    # Normal tokens are spelled in GPT-2's byte alphabet; a few converters store some as raw
    # UTF-8, which BPE could never produce, so respell those. Control / user-defined tokens are
    # raw text matched as added tokens and keep their spelling.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token_types[index] not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not _BYTE_ALPHABET.issuperset(token):
            token = "".join(_BYTE_TABLE[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)

    normalizer, pre_tokenizer, ignore_merges = factory()
    backend = tokenizers.Tokenizer(_bpe_model(source, vocab, merges, ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    fields: Mapping[str, Any], tokens: list[str], token_types: list[int], unk: int | None, source: str
) -> Any:
    """GGUF "llama": SentencePiece BPE as llama.cpp runs it.

    Spaces become "▁" and one "▁" is prepended to the text and to each stretch after a special
    token (``add_space_prefix``, llama.cpp's ``is_prev_special`` rule; the same as the Prepend +
    Replace normalizer of Llama's original ``tokenizer.json``). Characters missing from the
    vocabulary fall back to ``<0xNN>`` byte tokens. SentencePiece merges the adjacent pair whose
    result has the best score; as BPE ranks that is "merges sorted by score", derived from the
    vocabulary when the file lists no merges.
    """
    if "tokenizer.ggml.merges" in fields:
        merges = _merge_pairs(fields["tokenizer.ggml.merges"], source)
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if not isinstance(scores, (list, tuple)) or len(scores) != len(tokens):
            raise TokenizerError(f"{source}: SentencePiece vocabulary needs tokenizer.ggml.scores (one per token)")
        merges = _merges_from_scores(tokens, [float(s) for s in scores], token_types)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
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


def _merges_from_scores(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, best token score first."""
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked = []
    for index, token in enumerate(tokens):
        if token_types[index] != _TOKEN_NORMAL or len(token) < 2 or vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[index], index, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _compile_chat_template(source: str) -> Any:
    """Compile a chat template in the sandbox transformers uses (same options, globals and filters)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (training-mask markers): render the body as is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson HTML-escapes (<, >, &, '); transformers' does not, and templates expect that.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"invalid chat template: {exc}") from exc
