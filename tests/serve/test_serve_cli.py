"""`fastdecode serve` as a process: it loads a model folder, serves, and on SIGTERM lets the
in-flight stream finish before exiting 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import CHATML, free_port, hf_tokenizer


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny chat model saved as a Hugging Face folder (config, safetensors, tokenizer)."""
    import transformers as tf

    import torch

    folder = tmp_path_factory.mktemp("tiny_chat_model")
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer(320, ["<|endoftext|>", "<|im_start|>",
                                                                               "<|im_end|>"]),
                                           bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=1, eos_token_id=2)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_sigterm_drains_the_inflight_stream_then_exits_0(model_folder):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(model_folder),
                                "--port", str(port), "--grace-seconds", "30", "--model-name", "tiny"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        started, events = threading.Event(), []

        def stream() -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) > 10  # the stream ran on, whole


def test_cli_rejects_bad_settings_in_one_line(model_folder):
    from click.testing import CliRunner

    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["serve", "-m", str(model_folder), "--n-ctx", "100000"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error:") and "n_ctx" in result.output
    assert len(result.output.strip().splitlines()) == 1
    # --n-keep shapes the streaming cache of conversations past the context: without one it was ignored
    result = CliRunner().invoke(main, ["serve", "-m", str(model_folder), "--n-keep", "8"])
    assert result.exit_code == 2 and "n_keep=8" in result.output and "--context-overflow" in result.output


def test_cli_passes_the_api_surface_flags(model_folder, monkeypatch):
    from click.testing import CliRunner

    import fastdecode.serve.server as server_module
    from fastdecode.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "run", lambda generator, host, port, **settings: seen.update(settings) or 0)
    result = CliRunner().invoke(main, ["serve", "-m", str(model_folder), "--served-model-name", "a",
                                       "--served-model-name", "b", "--strict-model-name", "--allowed-origins",
                                       "http://x.test,http://y.test", "--embeddings", "--pooling", "last", "--lenient"])
    assert result.exit_code == 0, result.output
    assert (seen["model_name"], seen["model_aliases"], seen["strict_model_name"]) == ("a", ("b",), True)
    assert seen["allowed_origins"] == ("http://x.test", "http://y.test")
    assert (seen["embeddings"], seen["lenient"]) == ("last", True)
    result = CliRunner().invoke(main, ["serve", "-m", str(model_folder)])
    assert seen["embeddings"] is None and seen["model_name"] == model_folder.name and not seen["lenient"]


def test_ray_passes_the_api_surface_flags_to_its_service(model_folder, monkeypatch):
    """`serve --ray` takes every flag `serve` takes (issue 32's too) into the Ray service's settings."""
    pytest.importorskip("ray.serve")
    from click.testing import CliRunner

    import fastdecode.integrations.ray_serve.app as ray_app
    from fastdecode.cli import main

    seen = {}
    monkeypatch.setattr(ray_app, "run_service", lambda load, settings, options, *rest: seen.update(
        load=load, settings=settings, options=options) or 0)
    result = CliRunner().invoke(main, ["serve", "-m", str(model_folder), "--ray", "--replicas", "2",
                                       "--served-model-name", "a", "--served-model-name", "b", "--strict-model-name",
                                       "--allowed-origins", "http://x.test", "--embeddings", "--pooling", "last",
                                       "--lenient", "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    settings = seen["settings"]
    assert (settings.model_name, settings.model_aliases, settings.strict_model_name) == ("a", ("b",), True)
    assert settings.allowed_origins == ("http://x.test",)
    assert (settings.embeddings, settings.lenient) == ("last", True)
    assert seen["load"].quantize == "int8" and seen["options"].replicas == 2


def test_the_server_freezes_its_start_up_heap_before_serving(monkeypatch):
    """`run` hands uvicorn an app with start-up's objects frozen: a full garbage collection while
    requests stream does not walk the modules and the model again."""
    import gc

    from fastdecode.serve import server

    from serve_helpers import shared_chat_generator

    generator = shared_chat_generator()
    seen = {}

    def record(app, host, port):
        seen["frozen"] = gc.get_freeze_count()
        return 0

    monkeypatch.setattr(server, "serve_until_drained", record)
    gc.unfreeze()
    try:
        assert server.run(generator, "127.0.0.1", 0, model_name="tiny") == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000
