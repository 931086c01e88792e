"""Speculative decoding through the server: ``--speculative`` as the server's default, the
per-request ``speculative`` field (opt out, opt in, a bad value is a 400 naming it), the same text
as without, and drafted / accepted tokens in OpenAI's predicted-outputs usage fields."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, serve  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

PROMPT = "A cat sat on the mat and looked at the moon. A cat sat on the mat and"


@pytest.fixture(scope="module")
def speculating_server(chat_generator):
    with serve(chat_generator, max_queue=16, speculative="ngram") as running:
        yield running


def test_server_default_speculation_gives_the_same_text(speculating_server, chat_generator):
    expected = chat_generator.generate(PROMPT, max_new_tokens=24)
    client = speculating_server.client()
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert response.choices[0].text == expected
    details = response.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
    off = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"speculative": False})
    assert off.choices[0].text == expected and off.usage.completion_tokens_details is None
    # beam search runs without the server's default speculation (it cannot speculate)
    beams = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, extra_body={"num_beams": 2})
    assert beams.choices[0].finish_reason == "length"


def test_per_request_opt_in_and_bad_values(chat_generator):
    expected = chat_generator.generate(PROMPT, max_new_tokens=16, do_sample=True, seed=5, temperature=0.7)
    with serve(chat_generator, max_queue=4) as running:
        client = running.client()
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.7, seed=5,
                                             extra_body={"speculative": {"method": "ngram", "num_tokens": 4}})
        assert response.choices[0].text == expected
        for bad in ("medusa", {"num_tokens": 0}):
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"speculative": bad})
            assert caught.value.body["param"] == "speculative"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                      extra_body={"speculative": "ngram", "num_beams": 2})


def test_predicted_outputs_draft_from_the_prediction(speculating_server, chat_generator):
    """OpenAI's ``prediction`` field: drafts come from the expected output; the text is the model's own."""
    question = [{"role": "user", "content": "Repeat: a cat sat on the mat"}]
    expected = chat_generator.generate(question, max_new_tokens=20)
    client = speculating_server.client()
    wrong = client.chat.completions.create(model="tiny", messages=question, max_tokens=20, temperature=0,
                                           prediction={"type": "content", "content": "something else entirely"})
    assert wrong.choices[0].message.content == expected
    for prediction in (expected, [{"type": "text", "text": expected[:10]}, {"type": "text", "text": expected[10:]}]):
        response = client.chat.completions.create(model="tiny", messages=question, max_tokens=20, temperature=0,
                                                  prediction={"type": "content", "content": prediction})
        assert response.choices[0].message.content == expected
        # the prediction is the output (re-tokenized: a random model's token splits differ in places)
        accepted = response.usage.completion_tokens_details.accepted_prediction_tokens
        assert accepted >= 8 and accepted > wrong.usage.completion_tokens_details.accepted_prediction_tokens
    for bad, extra in (({"type": "content", "content": 5}, {}), ({"type": "content", "content": "x"},
                                                                {"speculative": False})):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=question, max_tokens=4, prediction=bad,
                                           extra_body=extra)
        assert caught.value.body["param"] == "prediction"


def test_constrained_and_stopped_outputs_with_speculation(speculating_server, chat_generator):
    client = speculating_server.client()
    expected = chat_generator.generate(PROMPT, max_new_tokens=30, stop=[" moon"])
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[" moon"])
    assert response.choices[0].text == expected
    question = [{"role": "user", "content": "Give a JSON object"}]
    expected = chat_generator.generate(question, max_new_tokens=24, response_format={"type": "json_object"})
    response = client.chat.completions.create(model="tiny", messages=question, max_tokens=24, temperature=0,
                                              response_format={"type": "json_object"})
    assert response.choices[0].message.content == expected
