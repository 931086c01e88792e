"""Whisper's special tokens and text decoding, read from the folder's ``tokenizer.json``.

Ids are looked up by their strings (``<|startoftranscript|>``, ``<|en|>``, ...), never assumed:
the English-only and multilingual vocabularies place them differently. Timestamp tokens follow
``<|notimestamps|>``: ``<|0.00|>`` is the next id, one per 0.02 s up to the end of the vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidOptionError, TokenizerError

TIME_PRECISION = 0.02  # seconds per timestamp token


@dataclass(frozen=True)
class WhisperVocabulary:
    tokenizer: object  # tokenizers.Tokenizer
    vocab_size: int  # the model's (timestamp tokens run up to it)
    eot: int
    sot: int
    transcribe: int
    translate: int
    sot_prev: int
    sot_lm: int | None
    no_timestamps: int
    no_speech: int | None
    languages: dict[str, int]  # code -> token id (empty for English-only models)

    @classmethod
    def from_folder(cls, folder: Path, vocab_size: int) -> "WhisperVocabulary":
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json: a Whisper folder needs its tokenizer")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type for a bad file
            raise TokenizerError(f"cannot read {path}: {exc}") from exc

        def token(text: str, required: bool = True) -> int | None:
            found = tokenizer.token_to_id(text)
            if found is None and required:
                raise TokenizerError(f"{path} has no {text} token: not a Whisper tokenizer")
            return found

        sot, translate = token("<|startoftranscript|>"), token("<|translate|>")
        multilingual = vocab_size >= 51865  # the English-only models have 51864 tokens (OpenAI's rule)
        languages = {}
        if multilingual:
            for text, index in tokenizer.get_vocab(with_added_tokens=True).items():
                match = re.fullmatch(r"<\|([a-z]{2,3}|haw|yue)\|>", text)
                if match and sot < index < translate:
                    languages[match.group(1)] = index
        no_speech = token("<|nospeech|>", False)
        return cls(tokenizer=tokenizer, vocab_size=vocab_size, eot=token("<|endoftext|>"), sot=sot,
                   transcribe=token("<|transcribe|>"), translate=translate, sot_prev=token("<|startofprev|>"),
                   sot_lm=token("<|startoflm|>", False), no_timestamps=token("<|notimestamps|>"),
                   no_speech=no_speech if no_speech is not None else token("<|nocaptions|>", False),
                   languages=dict(sorted(languages.items(), key=lambda item: item[1])))

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def language_id(self, code: str) -> int:
        if not self.multilingual:
            if code != "en":
                raise InvalidOptionError(f"this Whisper model is English-only; language {code!r} is not available")
            return -1
        if code not in self.languages:
            raise InvalidOptionError(f"unknown language {code!r}; known: {', '.join(self.languages)}")
        return self.languages[code]

    def language_code(self, token_id: int) -> str:
        return next(code for code, index in self.languages.items() if index == token_id)

    def sot_sequence(self, language: str | None, task: str, timestamps: bool) -> list[int]:
        """``<|startoftranscript|>`` [language, task] [``<|notimestamps|>``]: what every window starts with."""
        if task not in ("transcribe", "translate"):
            raise InvalidOptionError(f"task must be 'transcribe' or 'translate', got {task!r}")
        tokens = [self.sot]
        if self.multilingual:
            tokens += [self.language_id(language or "en"), self.transcribe if task == "transcribe" else self.translate]
        elif task == "translate":
            raise InvalidOptionError("this Whisper model is English-only: it cannot translate")
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of the ids below ``<|endoftext|>`` (timestamps and special tokens dropped)."""
        return self.tokenizer.decode([i for i in ids if i < self.eot])
