"""Medians with their min-max, percentiles, ratios, markdown tables, and in-process alternation
(``alternate``: a few callables timed in turn, A, B, A, B...)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (NaN when there is nothing)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def spread(values: list[float], digits: int = 1) -> str:
    """``median (min-max)``, or just the value when there is one."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def not_run(name: str, why: str, columns: int) -> list[str]:
    """A table row for an engine that did not run, with the reason: never an estimate."""
    return [name, f"NOT RUN ({why})"] + ["-"] * (columns - 2)


# --- in-process alternation ------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def alternate(calls: dict[str, Callable[[], Any]], reps: int, label: str = "") -> tuple[dict[str, list[float]],
                                                                                       dict[str, Any]]:
    """Time each callable once per repetition, in turn (A, B, A, B...): seconds per name, last results."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    results: dict[str, Any] = {}
    for rep in range(reps):
        for name, fn in calls.items():
            seconds, results[name] = timed(fn)
            times[name].append(seconds)
            print(f"  {label} {name} rep {rep + 1}/{reps}: {seconds:.2f}s", file=sys.stderr, flush=True)
    return times, results
