"""`/v1/audio/transcriptions` and `/v1/audio/translations` through the openai SDK, on Whisper
tiny.en (CTranslate2 weights) and espeak-ng speech."""

from __future__ import annotations

import json

import pytest

from test_whisper_real import OTHER_LANGUAGES, SENTENCES, base, speak, tiny_en, word_error_rate  # noqa: F401 - fixtures

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_en):  # noqa: F811 - the imported fixture
    from serve.serve_helpers import RunningServer

    import fastdecode
    from fastdecode.serve.audio import SpeechServeSettings, create_speech_app

    app = create_speech_app(fastdecode.load_speech(str(tiny_en)), SpeechServeSettings(model_name="tiny.en"))
    with RunningServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def speech_file(tmp_path_factory):
    voice, speed, _language, text = SENTENCES[0]
    return speak(tmp_path_factory.mktemp("speech"), voice, speed, text), text


def test_every_response_format(server, speech_file):
    path, text = speech_file
    client = server.client()
    with open(path, "rb") as audio:
        as_json = client.audio.transcriptions.create(model="tiny.en", file=audio)
    assert word_error_rate(text, as_json.text) < 0.2, as_json.text
    with open(path, "rb") as audio:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="verbose_json",
                                                     timestamp_granularities=["segment"])
    assert verbose.text == as_json.text and verbose.language == "en" and verbose.duration > 2
    assert verbose.segments[0].start == 0.0 and verbose.segments[-1].end <= verbose.duration + 0.5
    outputs = {}
    for fmt in ("text", "srt", "vtt"):
        with open(path, "rb") as audio:
            outputs[fmt] = client.audio.transcriptions.create(model="tiny.en", file=audio, response_format=fmt)
    assert outputs["text"].strip() == as_json.text
    assert outputs["srt"].startswith("1\n00:00:00,000 --> 00:00:0") and as_json.text in outputs["srt"]
    assert outputs["vtt"].startswith("WEBVTT\n\n00:00:00.000 --> 00:00:0") and as_json.text in outputs["vtt"]


def test_word_timestamps(server, speech_file):
    path, text = speech_file
    with open(path, "rb") as audio:
        result = server.client().audio.transcriptions.create(
            model="tiny.en", file=audio, response_format="verbose_json", timestamp_granularities=["word"])
    words = result.words
    assert "".join(w.word for w in words) == result.text.replace(" ", "") and len(words) >= len(text.split()) - 2
    assert all(a.start <= a.end <= b.start for a, b in zip(words, words[1:])) and words[-1].end <= result.duration + 0.5


def test_prompt_language_and_temperature_are_used(server, speech_file):
    path, text = speech_file
    with open(path, "rb") as audio:
        result = server.client().audio.transcriptions.create(
            model="tiny.en", file=audio, language="en", prompt="Restaurant booking.", temperature=0.0)
    assert word_error_rate(text, result.text) < 0.2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's audio.translations
def test_bad_requests_are_openai_errors(server, speech_file, tmp_path):
    import openai

    client = server.client()
    path, _ = speech_file
    not_audio = tmp_path / "notes.wav"
    not_audio.write_bytes(b"these are not audio samples" * 40)
    cases = [
        (dict(file=not_audio.open("rb")), 400, "not a readable audio file"),
        (dict(file=path.open("rb"), language="fr"), 400, "English-only"),
        (dict(file=path.open("rb"), model="other"), 404, "does not exist"),
    ]
    for kwargs, status, message in cases:
        kwargs.setdefault("model", "tiny.en")
        with pytest.raises(openai.APIStatusError) as info:
            client.audio.transcriptions.create(**kwargs)
        assert info.value.status_code == status and message in info.value.message
        kwargs["file"].close()
    with pytest.raises(openai.APIStatusError) as info, open(path, "rb") as audio:
        client.audio.translations.create(model="tiny.en", file=audio)
    assert info.value.status_code == 400 and "cannot translate" in info.value.message
    response = server.http.post("/v1/audio/transcriptions", content=b"{}", headers={"content-type": "application/json"})
    assert response.status_code == 400 and json.loads(response.text)["error"]["param"] == "file"
    # fields a route does not take, and words without the format that holds them (all were silently dropped)
    for route, fields, param in [("transcriptions", {"stream": "true"}, "stream"),
                                 ("transcriptions", {"include[]": "logprobs"}, "include[]"),
                                 ("transcriptions", {"colour": "red"}, "colour"),
                                 ("translations", {"language": "de"}, "language"),
                                 ("transcriptions", {"timestamp_granularities[]": "word"}, "timestamp_granularities")]:
        with open(path, "rb") as audio:
            response = server.http.post(f"/v1/audio/{route}", data={"model": "tiny.en", **fields},
                                        files={"file": ("speech.wav", audio, "audio/wav")})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_concurrent_requests_are_answered_together(server, speech_file):
    """Requests in flight at once are batched on the engine thread; each gets its own answer."""
    from concurrent.futures import ThreadPoolExecutor

    path, _ = speech_file
    client = server.client()

    def one(_):
        with open(path, "rb") as audio:
            return client.audio.transcriptions.create(model="tiny.en", file=audio, response_format="text")

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(one, range(3)))
    assert len(set(answers)) == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's audio.translations
def test_translations_on_the_multilingual_model(base, tmp_path):  # noqa: F811 - the imported fixture
    from serve.serve_helpers import RunningServer

    import fastdecode
    from fastdecode.serve.audio import SpeechServeSettings, create_speech_app

    voice, speed, _language, text = OTHER_LANGUAGES[0]
    path = speak(tmp_path, voice, speed, text)
    app = create_speech_app(fastdecode.load_speech(str(base)), SpeechServeSettings(model_name="base"))
    with RunningServer(app) as running, open(path, "rb") as audio:
        client = running.client()
        english = client.audio.translations.create(model="base", file=audio, response_format="verbose_json")
        audio.seek(0)
        french = client.audio.transcriptions.create(model="base", file=audio, response_format="verbose_json")
    assert english.language == "fr" == french.language
    assert "coffee" in english.text.lower() and "café" in french.text.lower(), (english.text, french.text)
