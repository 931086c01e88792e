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
