"""chat_session as an engine sequence kept between turns: a turn runs only its new tokens, and the
replies equal those of the streaming cache, before and after the conversation overflows n_ctx."""

from __future__ import annotations

import pytest

import fastdecode
from fastdecode.generation.chat import EngineConversation
from tiny_models import save_tiny_folder

pytest.importorskip("transformers")

MESSAGES = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10", "w11 w12 w13", "w14 w15", "w16 w17 w18 w19"]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_folder(folder, "llama-gqa")
    return fastdecode.load(str(folder))


def test_a_turn_runs_only_its_new_tokens(gen):
    session = gen.chat_session(n_ctx=128, max_new_tokens=5)
    "".join(session.send(MESSAGES[0]))
    conversation = session.engine
    assert isinstance(conversation, EngineConversation)
    held, run_before = conversation.next_position, conversation.tokens_run
    whole_before = conversation.sequence.num_tokens  # the first turn's tokens and its reply
    "".join(session.send(MESSAGES[1]))
    sequence = conversation.sequence
    assert sequence.num_cached_prompt_tokens == held == whole_before - 1  # all but the reply's last token
    # The model ran the last reply token, the new message and the reply but its last token: nothing earlier.
    assert conversation.tokens_run - run_before == sequence.num_tokens - 1 - held
    assert conversation.tokens_run - run_before < sequence.num_tokens - 1
    assert conversation.engine.cache.pool.num_free == conversation.engine.cache.pool.num_blocks - \
        len(sequence.block_table)  # the kept sequence owns its blocks, nothing else is held


def _replies(session, messages) -> tuple[list[str], list[str]]:
    replies, kinds = [], []
    for message in messages:
        replies.append("".join(session.send(message)))
        kinds.append("stream" if session.engine.streaming else "plain")
    return replies, kinds


@pytest.mark.parametrize("policy", ["shift", "reevaluate"])
# Seeded sampling: the tiny random model's greedy replies repeat the last token whatever came before,
# so they would not show a conversation handed over wrongly.
@pytest.mark.parametrize("options", [{"do_sample": True, "seed": 3, "temperature": 0.9},
                                     {"do_sample": True, "seed": 11, "top_k": 30, "repetition_penalty": 1.3}])
def test_replies_equal_the_streaming_cache_before_and_after_overflow(gen, policy, options):
    """n_ctx=40: the first turns run as a plain kept sequence, a later one switches it to the
    streaming policy; a session streaming from the start gives the same replies."""
    session = gen.chat_session(n_ctx=40, max_new_tokens=6, policy=policy, **options)
    reference = gen.chat_session(n_ctx=40, max_new_tokens=6, policy=policy, **options)
    reference.engine.switch_to_stream(reference.config)  # the streaming policy from the start
    replies, kinds = _replies(session, MESSAGES)
    expected, _ = _replies(reference, MESSAGES)
    assert replies == expected
    assert kinds[0] == "plain" and kinds[-1] == "stream"  # it did overflow
    # (a reply holding a special token renders differently: both start over from the rendering)
    assert session.messages == reference.messages and session.full_rebuilds == reference.full_rebuilds


def test_stopping_a_reply_early_keeps_the_conversation(gen):
    session = gen.chat_session(n_ctx=128, max_new_tokens=8)
    pieces = session.send(MESSAGES[0])
    next(pieces)
    pieces.close()  # the consumer stops reading: the reply is cancelled, what it computed is kept
    conversation = session.engine
    assert conversation.sequence.finish_reason == "cancelled" and conversation.sequence.block_table
    run_before, held = conversation.tokens_run, conversation.next_position
    "".join(session.send(MESSAGES[1]))
    assert conversation.sequence.num_cached_prompt_tokens == held
    assert conversation.tokens_run - run_before == conversation.sequence.num_tokens - 1 - held
