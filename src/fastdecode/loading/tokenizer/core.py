"""The tokenizer wrapper: a ``tokenizers.Tokenizer`` plus special ids and a chat template.

The BPE work itself is done by the Rust ``tokenizers`` library; this package only decides how to
*configure* it for each source a model can come from:

* a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json`` + generation config), here,
* a GGUF file's metadata (``from_gguf.py``: llama.cpp stores vocabulary, merges and token types,
  not a ``tokenizer.json``, so the normalizer / pre-tokenizer / decoder are rebuilt there),
* an in-memory ``transformers`` fast tokenizer (duck-typed), here.

``transformers`` is never imported here: it is heavy (seconds) and optional at runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from ...errors import TokenizerError
from ..jsonfile import read_json_object
from .chat_template import compile_chat_template, render_chat_template, select_chat_template
from .end_of_turn import template_end_of_turn_ids

def _gpt2_byte_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``), inverted:
    printable Latin-1 bytes stand for themselves, the other 68 for chr(256), chr(257), ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _gpt2_byte_table()


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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where it holds only part of a character (which
        ``decode([token_id])`` turns into U+FFFD): a byte-level BPE piece through GPT-2's byte <-> char
        table, a SentencePiece byte-fallback piece ``<0xNN>`` as its byte, a SentencePiece word with its
        leading space; else its decoded text."""
        text = self.decode([token_id], skip_special_tokens=False)
        piece = self.backend.id_to_token(int(token_id)) or ""
        if piece.startswith("\u2581") and text == piece[1:].replace("\u2581", " "):
            return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece drops a lone token's leading space
        if "\ufffd" not in text:
            return text.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if piece and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return text.encode("utf-8")

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
            self._compiled_template = compile_chat_template(self.chat_template)
        token_strings = {name: getattr(self, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return render_chat_template(self._compiled_template, messages, add_generation_prompt, token_strings, kwargs)

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
        template = select_chat_template(config.get("chat_template"), folder / "tokenizer_config.json")
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
        eos_ids.extend(template_end_of_turn_ids(backend, template))
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
    def from_gguf_fields(
        cls, fields: Mapping[str, Any], source: str = "GGUF metadata", path: Path | None = None
    ) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes from its metadata (key -> plain Python value).

        ``tokenizer.ggml.model`` picks the algorithm: ``"gpt2"`` is byte-level BPE with the word
        split named by ``tokenizer.ggml.pre``; ``"llama"`` is SentencePiece-style BPE (scores,
        ``<0xNN>`` byte fallback, spaces as "▁"). Control tokens (type 3) and the unknown token
        become special added tokens (matched whole, dropped by ``decode(skip_special_tokens=True)``);
        user-defined tokens (type 4) are matched whole but kept on decode, as llama.cpp and
        transformers do. ``source`` (e.g. the file path) is used in error messages; ``path``, the
        file the fields were read from, lets a large vocabulary's backend be cached (``cache.py``).
        """
        from .from_gguf import gguf_tokenizer_parts

        backend, options = gguf_tokenizer_parts(fields, source, path)
        return cls(backend, **options)

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
        template = select_chat_template(template, f"{type(hf_tokenizer).__name__}.chat_template")

        def attr(name: str) -> Any:
            value = getattr(hf_tokenizer, name, None)
            return value if isinstance(value, (int, str)) else None

        eos = attr("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else []
        eos_ids.extend(template_end_of_turn_ids(backend, template))
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


# --- helpers ---------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON config: {} when absent, TokenizerError when present but unreadable."""
    if not path.is_file():
        return {}
    return read_json_object(path, "tokenizer file", TokenizerError)


def _token_content(value: Any, name: str, where: Path) -> str | None:
    """bos_token & co. are a string or a serialized AddedToken dict with 'content'."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise TokenizerError(f"{where}: {name} should be a string or a dict with 'content', got {value!r}")


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    """Whether the backend's post-processor prepends BOS: ask it, whatever kind it is."""
    if bos_id is None or backend.post_processor is None:
        return False
    ids = backend.encode("", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id
