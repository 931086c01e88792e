"""Tokenizer loading and chat templates (SentencePiece GGUFs and streaming: test_tokenizer_stream.py).

Oracles: ``transformers`` (tokenizer from the embedded SmolLM2 GGUF, and a tokenizer saved to a
folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastdecode.errors import FastDecodeError, TokenizerError
from fastdecode.loading.tokenizer import Tokenizer
from hf_gguf import hf_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "abc123def 4567.89 and version 3.10.2, 2024-01-01",
    "Price: $1,000,000",
    "def f(x):\n    return x**2  # square\n",
    "héllo 世界 🤗",
    "Ünïcödé ñ ß Ωμέγα кириллица العربية",
    "family 👩\u200d👩\u200d👧 flag 🇫🇷",
    "   multiple   spaces  ",
    "line1\nline2\n\n\n\tTabbed\r\nwindows",
    "don't I'M you'LL",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    " leading and trailing ",
]

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


# --- fixtures (gguf_path, gguf_fields and smol are in tests/conftest.py) ------------------------------
@pytest.fixture(scope="module")
def hf_smol(gguf_path: Path, gguf_reader):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return hf_tokenizer(gguf_path, gguf_reader)


# --- GGUF (byte-level BPE) vs transformers -----------------------------------------------------
def test_gguf_build_is_fast(gguf_fields: dict) -> None:
    start = time.perf_counter()
    Tokenizer.from_gguf_fields(gguf_fields)
    elapsed = time.perf_counter() - start
    print(f"from_gguf_fields(SmolLM2): {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0  # typically ~0.1 s; generous for loaded CI machines


def test_gguf_special_ids(smol: Tokenizer, hf_smol) -> None:
    assert smol.bos_token_id == hf_smol.bos_token_id == 1
    assert smol.pad_token_id == hf_smol.pad_token_id == 2
    assert smol.eos_token_ids[0] == hf_smol.eos_token_id == 2  # <|im_end|>
    assert smol.add_bos_token is False  # tokenizer.ggml.add_bos_token = false
    assert smol.vocab_size == 49152 == len(hf_smol)
    assert smol.token_to_id("<|im_start|>") == 1
    assert smol.token_to_id("no-such-token") is None
    assert smol.special_token_ids == frozenset(range(17))  # the 17 control tokens


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(smol: Tokenizer, hf_smol, text: str) -> None:
    for add_special in (True, False):
        assert smol.encode(text, add_special_tokens=add_special) == hf_smol.encode(text, add_special_tokens=add_special)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trip(smol: Tokenizer, hf_smol, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.decode(ids, skip_special_tokens=False) == hf_smol.decode(ids, skip_special_tokens=False)
    assert smol.decode(ids, skip_special_tokens=True) == hf_smol.decode(ids, skip_special_tokens=True)


def test_gguf_specials_are_whole_and_skipped(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"


def test_gguf_digits_split_individually(smol: Tokenizer) -> None:
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" split) isolate every \p{N} character
    # before the GPT-2 regex. transformers' GGUF converter only applies the GPT-2 regex, which
    # differs on numerals other than 0-9 glued to a space (e.g. " ①"), so that string is not in
    # TEXTS; check the split directly instead.
    words = [w for w, _ in smol.backend.pre_tokenizer.pre_tokenize_str("a 12 x²")]
    assert words == ["a", "Ġ", "1", "2", "Ġx", "Â²"]
    assert smol.encode(" ①②") == smol.encode(" ") + smol.encode("①") + smol.encode("②")


def test_gguf_encode_batch(smol: Tokenizer) -> None:
    assert smol.encode_batch(TEXTS) == [smol.encode(t) for t in TEXTS]
    assert smol.encode_batch(TEXTS, add_special_tokens=False) == [smol.encode(t, False) for t in TEXTS]


def test_decode_accepts_numpy_and_torch_ids(smol: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    ids = smol.encode("héllo 世界")
    assert smol.decode(np.array(ids)) == "héllo 世界"
    torch = pytest.importorskip("torch")
    assert smol.decode(torch.tensor(ids)) == "héllo 世界"


def test_gguf_chat_template_matches_transformers(smol: Tokenizer, hf_smol) -> None:
    for add_generation_prompt in (True, False):
        ours = smol.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
        theirs = hf_smol.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
    prompt = smol.apply_chat_template(CONVERSATION)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert smol.encode(prompt) == hf_smol.encode(prompt)


def test_from_hf_tokenizer_matches(hf_smol, smol: Tokenizer) -> None:
    wrapped = Tokenizer.from_hf_tokenizer(hf_smol)
    assert wrapped.bos_token_id == 1 and wrapped.pad_token_id == 2 and wrapped.eos_token_ids[0] == 2
    assert wrapped.add_bos_token is False
    assert wrapped.chat_template == hf_smol.chat_template
    for text in TEXTS:
        assert wrapped.encode(text) == hf_smol.encode(text)
    assert wrapped.apply_chat_template(CONVERSATION) == smol.apply_chat_template(CONVERSATION)
    # The backend is a copy: enabling padding on transformers' object does not leak into ours.
    hf_smol.backend_tokenizer.enable_padding(length=64, pad_id=2)
    try:
        assert len(wrapped.encode("hi")) == len(hf_smol.encode("hi", padding=False))
    finally:
        hf_smol.backend_tokenizer.no_padding()


def test_from_hf_tokenizer_rejects_slow_tokenizers() -> None:
    class Slow:
        chat_template = None

    with pytest.raises(TokenizerError, match="not a fast"):
        Tokenizer.from_hf_tokenizer(Slow())


def test_module_does_not_import_transformers() -> None:
    code = "import sys, fastdecode.loading.tokenizer; sys.exit('transformers' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


# --- chat template behaviour ---------------------------------------------------------------------
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenizer, hello streaming.",
    "Numbers like 12345 and 67890 appear here.",
    "héllo 世界, unicode text with accents: café, naïve, über.",
    "def main():\n    print('hi')\n",
] * 20


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A small byte-level BPE trained here, saved by transformers like a Hub model folder."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = __import__("tokenizers").Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def test_hf_folder_matches_transformers(hf_folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    ours = Tokenizer.from_hf_folder(hf_folder)
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.pad_token_id == hf.pad_token_id == 0
    assert ours.eos_token_ids == [2, 0]  # tokenizer eos first, then generation_config's list
    assert ours.add_bos_token is False
    for text in TEXTS + SENTENCES[:5]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids) == text
    tools = [{"name": "lookup", "description": "<b>find</b> & 'quote'"}]
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt) == hf.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    # tojson must not HTML-escape (transformers overrides jinja's filter the same way)
    assert ours.apply_chat_template(CONVERSATION, tools=tools) == hf.apply_chat_template(
        CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "<b>find</b> & 'quote'" in ours.apply_chat_template(CONVERSATION, tools=tools)


def test_hf_folder_config_variants(hf_folder: Path, tmp_path: Path) -> None:
    """List-form chat_template, AddedToken-dict special tokens, config.json eos, BOS rules."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "variant"
    folder.mkdir()
    tokenizer_json = json.loads((hf_folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["chat_template"] = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "x"}]
    config["bos_token"] = {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "rstrip": False}
    # transformers v5 ignores this whenever tokenizer.json exists: the post-processor decides.
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))

    ours = Tokenizer.from_hf_folder(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.chat_template == TEMPLATE
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == [2, 0]
    texts = ("hello world", "", "<|im_start|>user\nhi<|im_end|>")
    assert ours.add_bos_token is False
    for text in texts:
        assert ours.encode(text) == hf.encode(text)

    # A post-processor that prepends BOS (Llama-style tokenizer.json) is honoured and reported.
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    ours = Tokenizer.from_hf_folder(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.add_bos_token is True
    for text in texts:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text)[0] == 1
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)

    # chat_template.jinja overrides the config's template
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_hf_folder(folder).apply_chat_template(CONVERSATION) == CONVERSATION[0]["content"] + "!"


def test_chat_template_errors(hf_folder: Path, smol: Tokenizer) -> None:
    ours = Tokenizer.from_hf_folder(hf_folder)
    with pytest.raises(TokenizerError, match="unknown role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(TokenizerError):
        ours.apply_chat_template("not a list")  # type: ignore[arg-type]
    bare = Tokenizer(smol.backend, eos_token_ids=[2])
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template(CONVERSATION)
    broken = Tokenizer(smol.backend, chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="invalid chat template"):
        broken.apply_chat_template(CONVERSATION)
    dated = Tokenizer(smol.backend, chat_template="{{ strftime_now('%Y') }}")
    assert dated.apply_chat_template(CONVERSATION) == time.strftime("%Y")


# --- errors --------------------------------------------------------------------------------------
def test_missing_folder_and_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_hf_folder(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="no tokenizer.json") as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value, FastDecodeError)


@pytest.mark.parametrize("content", ["{not json", "{}", '{"model": {"type": "BPE", "vocab": 3}}', ""])
def test_corrupt_tokenizer_json(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match="cannot read tokenizer") as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_corrupt_tokenizer_config(hf_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_folder / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TokenizerError, match="chat_template"):
        Tokenizer.from_hf_folder(tmp_path)


def _tiny_fields(**overrides) -> dict:
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
    }
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def test_tiny_gguf_fields_work() -> None:
    tok = Tokenizer.from_gguf_fields(_tiny_fields())
    assert tok.encode("abab<|end|>") == [2, 2, 3]
    assert tok.decode([2, 3]) == "ab"
    assert tok.eos_token_ids == [3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer model 'bert'"),
        ({"tokenizer.ggml.model": None}, "no tokenizer"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.pre": "klingon"}, "unsupported pre-tokenizer 'klingon'"),
        ({"tokenizer.ggml.merges": ["a c"]}, "invalid BPE"),
        ({"tokenizer.ggml.merges": ["abc"]}, "malformed merge"),
        ({"tokenizer.ggml.merges": None}, "merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type"),
        ({"tokenizer.ggml.model": "llama"}, "scores"),
    ],
)
def test_bad_gguf_fields(overrides: dict, message: str) -> None:
    fields = _tiny_fields(**overrides)
    if "tokenizer.ggml.merges" in overrides and overrides["tokenizer.ggml.merges"] is None:
        fields.pop("tokenizer.ggml.merges", None)
    if overrides.get("tokenizer.ggml.model") == "llama":
        fields.pop("tokenizer.ggml.merges")
    with pytest.raises(TokenizerError, match=message) as info:
        Tokenizer.from_gguf_fields(fields, source="model.gguf")
    if overrides.get("tokenizer.ggml.model") is not None or "tokenizer.ggml.model" not in overrides:
        assert "model.gguf" in str(info.value)
