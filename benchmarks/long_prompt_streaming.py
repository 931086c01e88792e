"""A long prompt through the streaming cache (issue 10, case 16): time to the first new token.

SmolLM2-135M (embedded), a ~1,680-token prompt from the seed texts, n_ctx=256, n_keep=4, one thread.
Compares the shift policy (chunked prefill: the prompt goes through the stream's slot-cache
sequence ``headroom`` tokens per forward, each query seeing its own window and sink frame),
re-evaluate, and ``score(n_ctx=256)``, all through the public API (``stream_ids`` up to
its first token, ``score``); runs alternate (harness.alternate), medians with min-max and ratios.

The old path, one token per forward through the full ring (what a prompt cost before chunking), is
timed as the same work through the public API: a stream of the prompt's first token and as many new
tokens as the rest of the prompt, each a one-token forward through the ring, shifting once it is full.
Its tokens are the model's, not the prompt's (a forward's cost does not depend on which token it
reads); that the chunked and the token-by-token feeds give the same logits is
tests/unit/test_streaming.py::test_shift_chunked_feed_equals_token_by_token.

    python benchmarks/long_prompt_streaming.py [--tokens 1680] [--reps 3] [--slow-reps 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fastdecode
import harness
from harness import median, spread

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"


def first_token(gen, ids: list[int], policy: str) -> int:
    """The first new token of a stream over ``ids`` (what its prefill produces)."""
    return next(iter(gen.stream_ids(ids, n_ctx=256, n_keep=4, policy=policy, max_new_tokens=1)))


def token_by_token(gen, ids: list[int]) -> int:
    """len(ids) one-token forwards through the full ring: the old path's work for a prompt of ``ids``."""
    steps = gen.stream_ids(ids[:1], n_ctx=256, n_keep=4, policy="shift", max_new_tokens=len(ids) - 1,
                           eos_token_id=[])
    return sum(1 for _ in steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1680)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slow-reps", type=int, default=1, help="runs of the one-token-per-forward path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = fastdecode.load()
    text = " ".join(path.read_text() for path in sorted(SEEDS.glob("*.txt")))
    ids = gen.tokenizer.encode(text)[: args.tokens]
    print(f"prompt {len(ids)} tokens, n_ctx 256; {harness.machine_line(1)}\n")
    times, _ = harness.alternate({"shift, chunked": lambda: first_token(gen, ids, "shift"),
                                  "reevaluate": lambda: first_token(gen, ids, "reevaluate"),
                                  "score(n_ctx=256)": lambda: gen.score(ids, n_ctx=256, n_keep=4)}, args.reps)
    if args.slow_reps:
        slow, fed = harness.alternate({"shift, one token per forward": lambda: token_by_token(gen, ids)},
                                      args.slow_reps)
        assert fed["shift, one token per forward"] == len(ids) - 1, fed  # no early stop: every forward ran
        times.update(slow)
    base = median(times["shift, chunked"])
    print(harness.table(["path", "seconds to the first token", "runs", "vs chunked shift"],
                        [[name, spread(values, 2), len(values), f"{median(values) / base:.2f}x"]
                         for name, values in times.items()]))


if __name__ == "__main__":
    main()
