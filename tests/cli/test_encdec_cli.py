"""`fastdecode generate` / `inspect` on a tiny BART folder with a tokenizer (the source is the prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from tiny_encdec import save_tiny_encdec_folder, single_thread  # noqa: F401 (autouse fixture)
from tiny_models import save_word_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bart-cli")
    save_tiny_encdec_folder(folder, "bart")
    return folder


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_generate_translates_the_source(bart_folder):
    result = run("generate", "--model", str(bart_folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "6",
                 "--min-new-tokens", "6", "--stats")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 6 and result.stdout.startswith("w")
    assert "6 new tokens" in result.stderr
    naive = run("generate", "-m", str(bart_folder), "-p", "w1 w2 w3", "--max-new-tokens", "6", "--min-new-tokens",
                "6", "--no-cache")
    assert naive.exit_code == 0 and naive.stdout == result.stdout


def test_inspect_shows_encoder_decoder_and_cross_cache(bart_folder):
    result = run("inspect", str(bart_folder))
    assert result.exit_code == 0, result.output
    for needle in ("BartForConditionalGeneration", "encoder layers", "decoder layers",
                   "cross attention cache bytes per source token", "learned absolute (offset 2)"):
        assert needle in result.stdout
    info = json.loads(run("inspect", str(bart_folder), "--json").stdout)
    assert info["cross_attention_cache_bytes_per_source_token"] == 2 * 3 * 2 * 32 * 4


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_bad_inputs_exit_2(bart_folder, tmp_path):
    too_long = run("generate", "-m", str(bart_folder), "-p", " ".join(["w1"] * 65), "--max-new-tokens", "4")
    assert too_long.exit_code == 2 and "only 64 positions" in too_long.stderr

    chat = run("generate", "-m", str(bart_folder), "-p", "w1", "--chat", "--max-new-tokens", "4")
    assert chat.exit_code == 2 and "chat templates" in chat.stderr

    no_start = _copy(bart_folder, tmp_path / "no-start")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((no_start / name).read_text())
        config.pop("decoder_start_token_id", None)
        config.pop("bos_token_id", None)
        (no_start / name).write_text(json.dumps(config))
    result = run("generate", "-m", str(no_start), "-p", "w1")
    assert result.exit_code == 2 and "decoder_start_token_id" in result.stderr

    mismatch = _copy(bart_folder, tmp_path / "mismatch")
    save_word_tokenizer(mismatch, vocab_size=500)
    result = run("generate", "-m", str(mismatch), "-p", "w1")
    assert result.exit_code == 2 and "500 tokens" in result.stderr
    assert all("Traceback" not in r.output for r in (too_long, chat, result))


def test_generate_with_beam_search_on_an_encoder_decoder(bart_folder):
    result = run("generate", "-m", str(bart_folder), "-p", "w1 w2 w3", "--num-beams", "4", "--num-return-sequences",
                 "2", "--no-repeat-ngram-size", "2", "--length-penalty", "2.0", "--max-new-tokens", "6",
                 "--encoder-no-repeat-ngram-size", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("--- ") == 2 and "score" in result.stdout
