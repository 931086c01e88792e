"""`fastdecode serve --ray` end to end: the command starts a private Ray (2 CPUs) with two model
replicas of 1 CPU each behind the ingress, once for the module; the tests talk to it with the
`openai` client and httpx and stop it with SIGTERM (exit 0).

The model is the tiny random Llama folder with a 4096-position context, so that long requests
are still running when a replica's process is killed (its pid comes from /health).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from serve_helpers import free_port, serve

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

KEY = "ray-serve-key"
START_TIMEOUT_S = 240  # Ray, Serve and two replicas on a shared two-core machine
REPLICA_HEADER = "x-fastdecode-replica"


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{3 + (start + 7 * k) % 150}" for k in range(n))


class Service:
    def __init__(self, base: str, folder, process: subprocess.Popen):
        self.base, self.folder, self.process = base, folder, process
        self.http = httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {KEY}"})

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kwargs.pop("api_key", KEY), max_retries=0,
                             timeout=60, **kwargs)

    def health(self) -> dict:
        return self.http.get("/health").json()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from tiny_models import save_tiny_folder

    folder = tmp_path_factory.mktemp("ray_serve_model")
    save_tiny_folder(folder, "llama-gqa", max_position_embeddings=4096)
    return folder


@pytest.fixture(scope="module")
def offline(model_folder):
    import fastdecode

    return fastdecode.load(str(model_folder))


@pytest.fixture(scope="module")
def service(model_folder, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("ray_serve_log") / "serve.log"
    command = [sys.executable, "-m", "fastdecode.cli", "serve", "--ray", "--replicas", "2", "-m", str(model_folder),
               "--port", str(port), "--model-name", "tiny", "--api-key", KEY, "--grace-seconds", "5"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_announce(process, log)
        yield Service(f"http://127.0.0.1:{port}", model_folder, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    assert code == 0, log.read_text()[-3000:]


def _wait_for_announce(process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if "fastdecode on Ray Serve: http://" in log.read_text():
            return
        assert process.poll() is None, log.read_text()[-3000:]
        time.sleep(0.25)
    raise AssertionError("the service did not start:\n" + log.read_text()[-3000:])


def test_greedy_answers_equal_the_single_server_and_offline(service, offline):
    """Completions (several prompts, token prompts), chat, beam search with n: the Serve endpoint
    answers what `fastdecode serve` answers, and what offline generation gives."""
    ray_client = service.client()
    requests = [
        ("completions", dict(prompt=["w5 w6 w7", "w9 w10"], max_tokens=12, temperature=0)),
        ("completions", dict(prompt=[offline.tokenizer.encode("w9 w10 w11")], max_tokens=6, temperature=0)),
        ("chat", dict(messages=[{"role": "user", "content": words(12)}], max_tokens=10, temperature=0)),
        ("completions", dict(prompt="w11 w12", max_tokens=8, n=2, extra_body={"num_beams": 2})),
    ]
    with serve(offline) as single:
        single_client = single.client()
        for kind, request in requests:
            answers = []
            for client in (ray_client, single_client):
                api = client.completions if kind == "completions" else client.chat.completions
                response = api.create(model="tiny", **request)
                texts = [c.text if kind == "completions" else c.message.content for c in response.choices]
                answers.append((texts, response.usage.prompt_tokens, response.usage.completion_tokens))
            assert answers[0] == answers[1], kind
    assert answers[0][0] == offline.generate("w11 w12", max_new_tokens=8, num_beams=2, num_return_sequences=2)
    expected = offline.generate(["w5 w6 w7", "w9 w10"], max_new_tokens=12)
    response = ray_client.completions.create(model="tiny", **requests[0][1])
    assert [c.text for c in response.choices] == expected


def test_streaming(service, offline):
    messages = [{"role": "user", "content": words(10, 3)}]
    chunks = list(service.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.generate(
        messages, max_new_tokens=12)
    assert chunks[-1].usage.completion_tokens == 12


def test_anthropic_messages_through_the_ingress(service, offline):
    """Issue 32's routes answer through Serve too: Anthropic's Messages API, x-api-key as the key."""
    messages = [{"role": "user", "content": words(8, 5)}]
    answer = httpx.post(service.base + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                        json={"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": messages})
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == offline.generate(messages, max_new_tokens=6)
    assert service.http.get("/v1/models/tiny").json()["id"] == "tiny"


def test_a_conversation_stays_on_one_replica_and_reuses_its_cache(service):
    """Six turns, each sending the whole history: all land on the replica that holds the
    conversation's blocks, and every turn after the first has cached prompt tokens."""
    client = service.client()
    messages = [{"role": "user", "content": words(40, 11)}]
    replicas, usages = [], []
    for turn in range(6):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=8,
                                                               temperature=0)
        response = raw.parse()
        replicas.append(raw.headers[REPLICA_HEADER])
        usages.append(response.usage)
        messages += [{"role": "assistant", "content": response.choices[0].message.content},
                     {"role": "user", "content": words(6, 50 + turn)}]
    assert len(set(replicas)) == 1, replicas
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == 0 and all(c >= usages[0].prompt_tokens // 2 for c in cached[1:]), cached


def test_api_key_bad_requests_metrics_and_health(service):
    with pytest.raises(openai.AuthenticationError) as info:
        service.client(api_key="wrong").completions.create(model="tiny", prompt="w5", max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    response = service.http.post("/v1/chat/completions", json={"model": "tiny", "messages": "Hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = service.http.post("/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 5000})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert service.http.get("/nowhere").json()["error"]["code"] == "not_found"
    assert service.http.get("/v1/models").json()["data"][0]["max_model_len"] == 4096
    health = httpx.get(service.base + "/health", timeout=30).json()  # no key needed
    assert health["status"] == "ok" and health["replicas"] == 2
    assert len({r["replica"] for r in health["by_replica"]}) == 2 and all(r["pid"] > 0 for r in health["by_replica"])
    metrics = httpx.get(service.base + "/metrics", timeout=30).text
    generated = re.findall(r'fastdecode_generated_tokens_total\{replica="(\w+)"\} (\S+)', metrics)
    assert len(generated) == 2 and sum(float(v) for _, v in generated) > 0
    assert 'fastdecode_ingress_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics


def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(service, offline):
    """Streams and whole requests that share one prompt run on one replica; its process is killed
    once the streams have started. The streams end with an error event (never a hang); every whole
    request is sent again to the other replica and answers exactly what it would have answered.
    Serve then starts a replacement replica."""
    prompt, tokens = words(20, 90), 1500
    warm = service.http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    victim = warm.headers[REPLICA_HEADER]
    before = {r["replica"]: r["pid"] for r in service.health()["by_replica"]}
    streams, wholes = asyncio.run(asyncio.wait_for(_load_and_kill(service, prompt, tokens, before[victim]), 150))
    assert streams and all(replica == victim for replica, _ in streams)
    for _, events in streams:
        assert events[-1] != "[DONE]" and json.loads(events[-1])["error"]["code"] == "replica_unavailable"
    expected = offline.generate(prompt, max_new_tokens=tokens)
    for status, replica, body in wholes:
        assert status == 200 and replica != victim, body
        assert body["choices"][0]["text"] == expected
    metrics = httpx.get(service.base + "/metrics", timeout=30).text
    assert float(re.search(r"^fastdecode_ingress_retries_total (\S+)$", metrics, re.M).group(1)) >= len(wholes)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Serve replaces the dead replica
        replicas = {r["replica"] for r in service.health()["by_replica"]}
        if len(replicas) == 2 and victim not in replicas:
            break
        time.sleep(1)
    assert len(replicas) == 2 and victim not in replicas, replicas


async def _load_and_kill(service: Service, prompt: str, tokens: int, victim_pid: int):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    started = [asyncio.Event() for _ in range(3)]
    async with httpx.AsyncClient(base_url=service.base, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        async def stream(started: asyncio.Event):
            events = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
            return response.headers[REPLICA_HEADER], events

        async def whole():
            response = await client.post("/v1/completions", json=body)
            return response.status_code, response.headers.get(REPLICA_HEADER), response.json()

        streams = [asyncio.create_task(stream(event)) for event in started]
        wholes = [asyncio.create_task(whole()) for _ in range(3)]
        await asyncio.gather(*(event.wait() for event in started))
        assert not any(task.done() for task in wholes), "the whole requests ended before the kill"
        os.kill(victim_pid, signal.SIGKILL)
        return await asyncio.gather(*streams), await asyncio.gather(*wholes)
