"""serve-speech's connections, through a real server on loopback: a client that disconnects cancels
its transcription; a chunked upload (no Content-Length) is held to the body limit as the others.
A stub transcriber asks the engine thread's batcher for encoder runs of a tiny random Whisper
(forever, for the audio ``b"forever"``), so the tests are fast and the batcher is the real one."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
pytest.importorskip("transformers")

from serve.serve_helpers import RunningServer  # noqa: E402
from tiny_whisper import FRAMES, MELS, build, save  # noqa: E402

from fastdecode.serve.audio import SpeechServeSettings, create_speech_app  # noqa: E402
from fastdecode.speech.loading import load_whisper  # noqa: E402
from fastdecode.speech.requests import Encode, Transcription  # noqa: E402

LIMIT = 4000


class StubTranscriber:
    def __init__(self, model):
        self.model, self.vocabulary = model, None
        self.encodes = 0  # Encode requests answered, all transcriptions together
        self.closed = threading.Event()  # a transcription's generator was closed before its end

    def options(self, **options):
        return options

    def steps(self, upload, options):
        audio = upload.read()
        try:
            while audio == b"forever":
                yield Encode(torch.zeros(MELS, FRAMES))
                self.encodes += 1
        except GeneratorExit:
            self.closed.set()
            raise
        return Transcription([], "en", 1.0, 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    save(build(), folder)
    stub = StubTranscriber(load_whisper(folder, need_vocabulary=False).model)
    app = create_speech_app(stub, SpeechServeSettings(model_name="tiny", max_body_bytes=LIMIT))
    with RunningServer(app) as running:
        running.stub = stub
        yield running


def multipart(audio: bytes) -> tuple[bytes, str]:
    boundary = "fastdecode-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + audio + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_a_small_upload_is_transcribed(server):
    body, content_type = multipart(b"short")
    response = server.http.post("/v1/audio/transcriptions", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 200 and response.json() == {"text": ""}


@pytest.mark.parametrize("declared", [True, False])
def test_an_upload_over_the_limit_is_refused_with_or_without_content_length(server, declared):
    body, content_type = multipart(b"x" * (2 * LIMIT))

    def chunked():  # httpx sends a generator with Transfer-Encoding: chunked, no Content-Length
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    response = server.http.post("/v1/audio/transcriptions", content=body if declared else chunked(),
                                headers={"Content-Type": content_type})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert server.http.get("/health").status_code == 200


def test_a_client_that_disconnects_cancels_its_transcription(server):
    stub, worker = server.stub, server.app.state.worker
    body, content_type = multipart(b"forever")
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(head + body)
        deadline = time.monotonic() + 20
        while stub.encodes < 3:  # the transcription runs on the engine thread
            assert time.monotonic() < deadline, "the transcription did not start"
            time.sleep(0.01)
    assert stub.closed.wait(10), "the transcription went on after its client left"
    deadline = time.monotonic() + 5
    while worker.batcher.open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.batcher.open
    encodes = stub.encodes
    time.sleep(0.2)
    assert stub.encodes == encodes  # nothing runs for it any more
    test_a_small_upload_is_transcribed(server)  # and the server still answers
