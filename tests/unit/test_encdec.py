"""Encoder-decoder engine: the encoder and the cross-attention K/V run once per call; bad input is typed."""

from __future__ import annotations

import json

import pytest
import importlib

import torch

import fastdecode
from fastdecode.errors import (
    CheckpointError,
    InvalidOptionError,
    PromptTooLongError,
    TokenizerError,
    UnsupportedModelError,
)
from fastdecode.engine.cross import EncodedSources
from tiny_encdec import build, save_tiny_encdec_folder, single_thread  # noqa: F401 (autouse fixture)
from tiny_models import save_word_tokenizer

pytest.importorskip("transformers")


def _count_linear(monkeypatch, module, weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Counts the family module's ``linear`` calls per weight tensor (by identity)."""
    names = {id(w): name for name, w in weights.items()}
    counts = dict.fromkeys(weights, 0)
    original = module.linear

    def counted(x, weight, *args, **kwargs):
        name = names.get(id(weight))
        if name is not None:
            counts[name] += 1
        return original(x, weight, *args, **kwargs)

    monkeypatch.setattr(module, "linear", counted)
    return counts


def _count_calls(monkeypatch, model, method: str) -> list[int]:
    calls = [0]
    original = getattr(model, method)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(model, method, counted)
    return calls


@pytest.mark.parametrize("kind", ["bart", "t5"])
@pytest.mark.parametrize("new_tokens, num_beams", [(3, 1), (17, 1), (17, 3)])
def test_encoder_and_cross_kv_run_once_per_call(monkeypatch, kind, new_tokens, num_beams):
    """Greedy (the engine) and beam search alike: one encoder call for every source of the call,
    the cross K/V projected once, one decoder pass per new token (all beams in it)."""
    gen = fastdecode.from_hf(build(kind))
    model = gen.model
    steps = _count_calls(monkeypatch, model, "decode")
    layers = model.decoder.layers
    cross = {f"{layer}.cross_{p}": getattr(layers[layer], f"cross_{p}")
             for layer in range(model.config.num_layers) for p in ("k", "v", "q") if hasattr(layers[layer], f"cross_{p}")}
    # BART runs its cross K and V as one fused product (layers/fused.py): count that module's calls too
    fused = {f"{layer}.cross_kv.{i}": weight for layer in range(model.config.num_layers)
             if hasattr(layers[layer], "cross_kv") for i, (weight, _) in enumerate(layers[layer].cross_kv.parts)}
    counts = _count_linear(monkeypatch, importlib.import_module(f"fastdecode.models.{kind}"), cross)
    fused_counts = _count_linear(monkeypatch, importlib.import_module("fastdecode.layers.fused"), fused)
    encoded_rows = _count_rows(monkeypatch, model, "encode")
    out = gen.generate_ids([[5, 6, 7, 8], [9, 10]], max_new_tokens=new_tokens, eos_token_id=[], num_beams=num_beams)
    assert [len(o) for o in out] == [new_tokens, new_tokens]
    assert encoded_rows == [2]  # one encoder call, each source once, whatever the beam count
    assert steps[0] == new_tokens  # one decoder pass per new token
    for name, count in {**counts, **fused_counts}.items():
        expected = new_tokens if name.endswith("q") else 1  # the query is per step, K and V once
        assert count == expected, (name, count)


def _count_rows(monkeypatch, model, method: str) -> list[int]:
    """The batch size of each call of ``model.method`` (its first argument's rows)."""
    rows = []
    original = getattr(model, method)
    monkeypatch.setattr(model, method, lambda tokens, *args, **kwargs: (rows.append(tokens.shape[0]),
                                                                        original(tokens, *args, **kwargs))[1])
    return rows


def test_naive_loop_recomputes_encoder_every_step(monkeypatch):
    gen = fastdecode.from_hf(build("bart"))
    encodes = _count_calls(monkeypatch, gen.model, "encode")
    gen.generate_ids([[5, 6, 7]], max_new_tokens=6, eos_token_id=[], use_cache=False)
    assert encodes[0] == 6


def test_cross_store_layout_and_bytes():
    """The engine's cross store (engine/cross.py, engine/source_blocks.py): at admission each
    source's cross K/V are written once, real tokens only, into blocks of its own ([blocks, H, block,
    D] per decoder layer: a head's keys consecutive within a block), equal to the encoder's; a
    finished or cancelled sequence's cross blocks go back at once."""
    gen = fastdecode.from_hf(build("bart"))
    cfg = gen.config
    sources = [[5, 6, 7, 8, 9], [10, 11]]
    engine = gen.engine()
    store = engine.cross.cache
    first, second = (engine.submit(s, {"max_new_tokens": 4, "min_new_tokens": 4}) for s in sources)
    engine.step()  # admits both: the encoder runs once over the two sources
    assert store.layer_keys[0].shape == (store.pool.num_blocks, cfg.num_heads, store.block_size, cfg.head_dim)
    assert store.block_nbytes == store.block_size * cfg.cross_cache_bytes_per_source_token(4)
    assert store.pool.num_blocks - store.pool.num_free == 2  # one block per source (5 and 2 tokens)
    encoded = EncodedSources.encode(gen.model, sources)  # [B, H, S, D] per layer, right-padded
    for row, (sequence, source) in enumerate(zip((first, second), sources)):
        block = store.layer_keys[0][sequence.source_table[0]]  # [H, block, D]
        torch.testing.assert_close(block[:, : len(source)], encoded.keys[0][row, :, : len(source)], atol=1e-6, rtol=0)
        for layer in range(cfg.num_layers):
            keys, values = store.read(layer, sequence.source_table, len(source))  # [H, L, D] each
            torch.testing.assert_close(keys, encoded.keys[layer][row, :, : len(source)], atol=1e-6, rtol=0)
            torch.testing.assert_close(values, encoded.values[layer][row, :, : len(source)], atol=1e-6, rtol=0)
    second.cancel()
    engine.step()
    assert second.source_table == [] and store.pool.num_blocks - store.pool.num_free == 1
    while engine.has_work():
        engine.step()
    assert store.pool.num_free == store.pool.num_blocks


def test_inspect_shows_encoder_decoder_and_cross_cache():
    info = fastdecode.from_hf(build("bart")).inspect()
    assert (info["encoder_layers"], info["decoder_layers"]) == (2, 3)
    assert info["cross_attention_cache_bytes_per_source_token"] == 2 * 3 * 2 * 32 * 4  # K+V, layers, H, D, fp32
    assert info["kv_cache_bytes_per_target_token"] == 2 * 3 * 2 * 32 * 4
    assert info["position_scheme"] == "learned absolute (offset 2)" and info["decoder_start_token_id"] == 2
    t5 = fastdecode.from_hf(build("t5")).inspect()
    assert t5["position_scheme"] == "relative buckets" and t5["max_source_positions"].startswith("unbounded")


# -- bad input -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bart")
    save_tiny_encdec_folder(folder, "bart")
    return folder


def _copy(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_text_in_text_out(bart_folder):
    gen = fastdecode.load(str(bart_folder))
    text = gen.generate("w1 w2 w3", max_new_tokens=5, min_new_tokens=5)
    assert isinstance(text, str) and len(text.split()) == 5
    options = dict(max_new_tokens=3, min_new_tokens=3)
    assert gen.generate(["w4", "w5 w6"], **options) == [gen.generate("w4", **options), gen.generate("w5 w6", **options)]
    assert list(gen.stream_ids([5, 6, 7], max_new_tokens=4, min_new_tokens=4)) == gen.generate_ids(
        [[5, 6, 7]], max_new_tokens=4, min_new_tokens=4)[0]


def test_source_longer_than_positions(bart_folder):
    gen = fastdecode.load(str(bart_folder))  # 64 positions
    assert len(gen.generate_ids([[5] * 64], max_new_tokens=2)[0]) <= 2
    with pytest.raises(PromptTooLongError, match="source 1 has 65 tokens.*only 64 positions"):
        gen.generate_ids([[5], [5] * 65], max_new_tokens=2)
    with pytest.raises(PromptTooLongError, match="max_new_tokens=65 exceeds the 64 positions"):
        gen.generate_ids([[5]], max_new_tokens=65)


def test_t5_sources_have_no_position_limit():
    gen = fastdecode.from_hf(build("t5"))
    assert len(gen.generate_ids([[5] * 600], max_new_tokens=2, min_new_tokens=2)[0]) == 2


def test_config_without_decoder_start_token(bart_folder, tmp_path):
    folder = _copy(bart_folder, tmp_path / "m")
    for name in ("config.json", "generation_config.json"):
        _edit_json(folder / name, decoder_start_token_id=None, bos_token_id=None)
    with pytest.raises(CheckpointError, match="neither decoder_start_token_id nor bos_token_id"):
        fastdecode.load(str(folder))


def test_tokenizer_that_does_not_match_the_vocabulary(bart_folder, tmp_path):
    folder = _copy(bart_folder, tmp_path / "m")
    save_word_tokenizer(folder, vocab_size=500)
    with pytest.raises(TokenizerError, match="500 tokens"):
        fastdecode.load(str(folder))


def test_missing_and_unexpected_weights_listed_together(bart_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(bart_folder, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.decoder.layers.2.encoder_attn.k_proj.weight"]
    del tensors["model.encoder.layers.1.fc1.bias"]
    tensors["model.decoder.layers.0.mystery.weight"] = tensors["final_logits_bias"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        fastdecode.load(str(folder))
    message = str(info.value)
    for name in ("model.decoder.layers.2.encoder_attn.k_proj.weight", "model.encoder.layers.1.fc1.bias",
                 "model.decoder.layers.0.mystery.weight"):
        assert name in message


def test_untied_encoder_embedding_is_refused(bart_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(bart_folder, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.encoder.embed_tokens.weight"] = tensors["model.shared.weight"] + 1.0
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="encoder_embed"):
        fastdecode.load(str(folder))


def test_unsupported_variants(bart_folder, tmp_path):
    folder = _copy(bart_folder, tmp_path / "m")
    _edit_json(folder / "config.json", model_type="marian", architectures=["MarianMTModel"],
               share_encoder_decoder_embeddings=False)
    with pytest.raises(UnsupportedModelError, match="share_encoder_decoder_embeddings"):
        fastdecode.load(str(folder))
    _edit_json(folder / "config.json", model_type="bart", architectures=["BartForConditionalGeneration"],
               activation_function="softsign")
    with pytest.raises(UnsupportedModelError, match="softsign"):
        fastdecode.load(str(folder))


def test_chat_and_score_are_for_decoder_only(bart_folder):
    gen = fastdecode.load(str(bart_folder))
    with pytest.raises(InvalidOptionError, match="chat templates"):
        gen.generate("w1", chat=True)
    with pytest.raises(InvalidOptionError, match="score"):
        gen.score([5, 6, 7])
