"""`fastdecode serve-speech`: a Whisper model behind OpenAI's /v1/audio/transcriptions and
/v1/audio/translations (click only; the server is imported when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import InvalidOptionError
from .errors import handle_errors


@click.command("serve-speech")
@click.option("--model", "-m", required=True, help="A Whisper folder (CTranslate2 model.bin or HF safetensors).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, envvar="FASTDECODE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/ routes (or env FASTDECODE_API_KEY).")
@click.option("--max-body-bytes", type=int, default=25 << 20, show_default=True, help="Largest upload.")
@click.option("--grace-seconds", type=float, default=30.0, show_default=True,
              help="On SIGTERM, how long in-flight requests may still run.")
@click.option("--model-name", default=None, help="The model id clients send (default: the folder name; "
                                                 "'whisper-1' is always accepted).")
@click.option("--quantize", type=click.Choice(["int8", "int4"]), default=None,
              help="Quantize the weights at load (default: float32).")
@handle_errors
def serve_speech(model: str, host: str, port: int, api_key: str | None, max_body_bytes: int, grace_seconds: float,
                 model_name: str | None, quantize: str | None) -> None:
    """Serve a Whisper model over OpenAI's audio API (transcriptions; translations when multilingual)."""
    try:
        import multipart  # noqa: F401 - python-multipart: FastAPI's form parser

        from ..serve.audio import SpeechServeSettings, run_speech_server
    except ImportError as exc:
        raise InvalidOptionError(f"fastdecode serve-speech needs the serve extra and python-multipart: "
                                 f"pip install 'fastdecode[serve,speech]' ({exc})") from exc
    from .. import load_speech

    settings = SpeechServeSettings(model_name=model_name or Path(model).name, api_key=api_key,
                                   max_body_bytes=max_body_bytes, grace_seconds=grace_seconds)
    sys.exit(run_speech_server(load_speech(model, quantize=quantize), host, port, settings))
