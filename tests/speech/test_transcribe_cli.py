"""`fastdecode transcribe` and `fastdecode serve-speech` on the command line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from test_whisper_real import SENTENCES, speak, tiny_en, word_error_rate  # noqa: F401 - tiny_en: a fixture

from fastdecode.cli import main


@pytest.mark.slow
def test_transcribe_writes_srt_and_a_folder_of_json(tiny_en, tmp_path):  # noqa: F811 - the imported fixture
    voice, speed, _language, text = SENTENCES[0]
    audio = speak(tmp_path, voice, speed, text)
    runner = CliRunner()
    result = runner.invoke(main, ["transcribe", str(audio), "-m", str(tiny_en), "-o", str(tmp_path / "out.srt"),
                                  "--no-progress"])
    assert result.exit_code == 0, result.output
    srt = (tmp_path / "out.srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> ") and word_error_rate(text, srt.split("\n", 2)[2]) < 0.2
    second = tmp_path / "copy.wav"
    second.write_bytes(audio.read_bytes())
    result = runner.invoke(main, ["transcribe", str(audio), str(second), "-m", str(tiny_en), "-o",
                                  str(tmp_path / "outs"), "--format", "verbose_json", "--beam-size", "1",
                                  "--word-timestamps", "--no-progress"])
    assert result.exit_code == 0, result.output
    for path in (audio, second):
        data = json.loads((tmp_path / "outs" / (path.stem + ".json")).read_text())
        assert data["language"] == "en" and data["segments"][0]["start"] == 0.0
        assert "".join(w["word"] for w in data["words"]) == data["text"].replace(" ", "")  # every word, once
        assert data["words"][-1]["end"] <= data["duration"] + 0.5


def test_transcribe_format_without_an_output_file_goes_to_stdout(tiny_en, tmp_path):  # noqa: F811
    """--format without -o was ignored: stdout got the segment listing whatever the format."""
    voice, speed, _language, text = SENTENCES[0]
    audio = speak(tmp_path, voice, speed, text)
    result = CliRunner().invoke(main, ["transcribe", str(audio), "-m", str(tiny_en), "--format", "srt",
                                       "--beam-size", "1", "--no-progress"])
    assert result.exit_code == 0 and result.stdout.startswith("1\n00:00:00,000 --> "), result.output


def test_transcribe_errors_exit_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["transcribe", str(tmp_path / "missing.wav"), "-m", str(tmp_path)])
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    result = runner.invoke(main, ["transcribe", str(tmp_path / "a.wav"), "-m", str(tmp_path), "-o",
                                  str(tmp_path / "out.doc")])
    assert result.exit_code == 2 and "suffix" in result.output
    result = runner.invoke(main, ["transcribe", str(tmp_path / "a.wav"), "-m", str(tmp_path / "nowhere"), "-o",
                                  str(tmp_path / "out.srt")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = runner.invoke(main, ["serve-speech", "-m", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output
