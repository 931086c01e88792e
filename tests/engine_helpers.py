"""Driving an engine in tests: requests arriving at given steps."""

from __future__ import annotations


def run_arrivals(engine, arrivals: dict[int, list[tuple[list[int], dict]]]) -> list[list[int]]:
    """Submit each request at its arrival step, step until done -> output ids in submission order."""
    return [s.output_ids for s in run_arrival_sequences(engine, arrivals)]


def run_arrival_sequences(engine, arrivals: dict[int, list[tuple[list[int], dict]]]) -> list:
    """``run_arrivals`` -> the finished sequences themselves (a beam group's results are on its root)."""
    sequences, step = [], 0
    while arrivals or engine.has_work():
        for prompt, options in arrivals.pop(step, []):
            sequences.append(engine.submit(prompt, options))
        engine.step()
        step += 1
    assert all(s.finished for s in sequences)
    return sequences


def run_short_requests(engine, count: int, tokens: range, max_prompt: int) -> list:
    """Submit ``count`` short random requests (ids from ``tokens``), step until all are done ->
    weak references to their sequences, which the engine must not keep alive."""
    import random
    import weakref

    rng = random.Random(0)
    refs = []
    for _ in range(count):
        sequence = engine.submit([rng.choice(tokens) for _ in range(rng.randint(1, max_prompt))],
                                 {"max_new_tokens": rng.randint(1, 3)})
        refs.append(weakref.ref(sequence))
    del sequence
    while engine.has_work():
        engine.step()
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert not engine.running and not engine.waiting
    return refs


class OneSequence:
    """One sequence run through the engine's own forward (its slot cache, a ``StepPlan`` of one row)
    on an engine of its own, with every position's logits kept: what the parity tests compare with
    transformers, position by position. ``run(ids, prompt)`` appends ``ids`` (their arithmetic role:
    prompt rows, or generated rows as a decode step runs them) -> their logits [T, V].

    With ``source`` (an encoder-decoder model) the source is encoded once into the engine's cross
    store, as its admission does (engine/cross.py), and ``ids`` are the decoder's tokens."""

    def __init__(self, gen, capacity: int, source: list[int] | None = None):
        from types import SimpleNamespace

        self.engine = gen.engine(cache_tokens=capacity, max_queue=1, cuda_graphs=False)
        self.table, _ = self.engine.cache.allocate([], capacity, self.engine.max_chunk)
        self.length = 0
        self.holder = None  # what the cross store keeps a source's blocks on (a sequence's two fields)
        if source is not None:
            self.holder = SimpleNamespace(source=list(source), source_table=[])
            self.engine.cross.admit(self.holder)
            self.engine.cross.encode_pending()

    def run(self, ids: list[int], prompt: bool = True):
        import torch

        from fastdecode.engine.plan import StepPlan
        from fastdecode.layers.products import Products

        engine, model, pieces = self.engine, self.engine.model, []
        with torch.inference_mode():
            for first in range(0, len(ids), engine.max_chunk):  # the engine's longest chunk
                chunk = ids[first : first + engine.max_chunk]
                start, count = self.length, len(chunk)
                engine.cache.prepare(self.table, start, start + count)
                products = Products.of_rows(prompt, torch.get_num_threads(), model.device, kernels=model.kernels)
                plan = StepPlan.for_rows(engine.cache, [(self.table, start, count)], engine.windows, engine.score_bias,
                                         model.dtype, products)
                tokens = torch.tensor([chunk], device=model.device)  # [1, T]
                positions = torch.arange(start, start + count, device=model.device)[None]  # [1, T]
                logits_at = torch.arange(count, device=model.device)
                if self.holder is None:
                    logits = model.forward(tokens, positions, plan, logits_at=logits_at)
                else:  # one cross-attention group: this sequence's ``count`` queries over its source
                    logits = model.decode(tokens, positions, plan, engine.cross.step([(0, [self.holder], count)]),
                                          logits_at=logits_at)
                pieces.append(logits[0])  # [T, V]
                self.length += count
        return torch.cat(pieces)


def prompt_logits(gen, ids: list[int]):
    """Logits [T, V] at every position of ``ids`` run as one prompt through the engine's forward."""
    return OneSequence(gen, len(ids)).run(ids)


def reference_logprobs(gen, ids: list[int], top: int = 0):
    """log P(ids[i + 1] | ids[:i + 1]) for each position from one forward over the text alone
    (``prompt_logits``), and with ``top`` > 0 the ``top`` best (token id, logprob) pairs there:
    what the engine's scoring sequences are compared with."""
    import torch

    logprobs = prompt_logits(gen, ids[:-1]).float().log_softmax(dim=-1)  # [T, V]
    chosen = logprobs.gather(1, torch.tensor(ids[1:], device=logprobs.device)[:, None])[:, 0].tolist()
    if top == 0:
        return chosen, [[] for _ in chosen]
    values, index = logprobs.topk(top, dim=-1)  # [T, top]
    return chosen, [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
