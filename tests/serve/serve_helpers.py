"""Tiny models behind real servers on 127.0.0.1 (a free port each), and their fixtures.

Test modules import the fixtures they use from here (not a conftest.py: a second module named
``conftest`` would shadow tests/conftest.py for tests that import from it). The chat model is
built once per test session (``shared_chat_generator``); each module gets its own server.

The decoder is a seeded random Llama (GQA) whose vocabulary is a byte-level BPE trained here with
a ChatML template; the encoder-decoder is tiny BART (tests/tiny_encdec.py) with the same kind of
tokenizer. Random weights rarely emit EOS, so lengths are set by max_tokens.
"""

from __future__ import annotations

import functools
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SENTENCES = [
    "The capital of France is Paris.", "Streaming servers send tokens as they are generated.",
    "A cat sat on the mat and looked at the moon.", "Numbers like 12, 345 and 6789 appear here.",
    "Hello, how are you today? I am fine, thank you!", "def add(a, b):\n    return a + b\n",
] * 20


def hf_tokenizer(vocab_size: int, specials: list[str]):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(SENTENCES, trainer)
    return backend


# family -> (config class, model class, options): the decoder families a chat model can be
CHAT_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
                 "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0,
                                                                     "residual_multiplier": 0.5,
                                                                     "attention_multiplier": 0.2, "logits_scaling": 0.5}),
                 "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
                 "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {})}


def tiny_chat_generator(seed: int = 0, quantize: str | None = None, family: str = "llama",
                        chat_template: str = CHATML, extra_specials: tuple[str, ...] = (),
                        max_positions: int = 256):
    """A fastdecode Generator: tiny random decoder (Llama, or another of ``CHAT_FAMILIES``) + trained
    BPE with <|im_end|> as EOS and ChatML, or ``chat_template`` (``quantize``: as ``from_hf``'s;
    ``extra_specials``: more special tokens in the vocabulary, e.g. fill-in-the-middle ones;
    ``max_positions``: its context)."""
    import torch
    import transformers as tf

    import fastdecode

    backend = hf_tokenizer(320, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials])
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                           eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config_class, model_class, options = CHAT_FAMILIES[family]
    config = getattr(tf, config_class)(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=112,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                                       tie_word_embeddings=False, **options)
    model = getattr(tf, model_class)(config).eval()
    with torch.no_grad():  # a peaked output layer: varied, not uniform, token choices
        model.lm_head.weight.mul_(8.0)
    return fastdecode.from_hf(model, tokenizer, quantize=quantize)


def tiny_family_generator(kind: str):
    """A fastdecode Generator: tests/tiny_models.py's ``kind`` (e.g. "phi3-longrope", "gemma2") with
    the chat tokenizer of ``tiny_chat_generator``."""
    import transformers as tf
    from tiny_models import build

    import fastdecode

    backend = hf_tokenizer(320, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                           eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return fastdecode.from_hf(build(kind, vocab_size=len(tokenizer), bos_token_id=1), tokenizer)


def tiny_bart_generator():
    """tests/tiny_encdec.py's tiny BART with a vocabulary as large as the byte-level tokenizer's."""
    import torch
    import transformers as tf
    from tiny_encdec import _bart_family

    import fastdecode

    backend = hf_tokenizer(320, ["<s>", "<pad>", "</s>"])  # bos 0, pad 1, eos 2 as tiny BART's config
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                           pad_token="<pad>")
    torch.manual_seed(0)
    model = tf.BartForConditionalGeneration(tf.BartConfig(**_bart_family(vocab_size=320, decoder_start_token_id=2)))
    model.eval()
    model.generation_config.forced_eos_token_id = None
    model.generation_config.forced_bos_token_id = None
    return fastdecode.from_hf(model, tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """uvicorn serving an app on a background thread; ``url`` is its /v1 base."""

    def __init__(self, app):
        import uvicorn

        from fastdecode.serve.server import uvicorn_config

        self.app = app
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RunningServer":
        import httpx

        self.http = httpx.Client(base_url=self.base, timeout=60)  # one client: a new one costs ~0.1 s
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             timeout=60, **kwargs)

    @property
    def service(self):
        return self.app.state.service


def serve(generator, **settings) -> RunningServer:
    from fastdecode.serve import ServeSettings, create_app

    return RunningServer(create_app(generator, ServeSettings(model_name="tiny", **settings)))


@functools.cache
def shared_chat_generator():
    return tiny_chat_generator()


@pytest.fixture(scope="module")
def chat_generator():
    return shared_chat_generator()


@pytest.fixture(scope="module")
def server(chat_generator):
    with serve(chat_generator, max_queue=64) as running:
        yield running
