"""Up to how many rows the float kernel reads the weights in place: measured once per machine, then read from a file.

The float kernel's AVX-512 path (layers/fmatmul_avx512.cpp) runs 9 or more rows one of two ways: in place, 8-row
groups taking turns over short runs of w's rows while those stay in L1 (a serving step's or a beam step's rows),
or from a packed copy of each column block of w, made once and then streamed from L2 by every group (a prompt's
rows). Both give every output the same operations (the float kernel's contract, layers/fmatmul.cpp: the same bits,
which tests/unit/test_float_rows_choice.py checks); which is faster at 16 to 64 rows depends on the L1 and L2
sizes and on the prefetchers. On the 2-core AMD EPYC Zen 5 they were tuned on, in place won up to 64 rows where w's
rows spread over L1's sets and up to 32 where they all fall in the same sets (rows a multiple of 4 KiB long: a
3072-wide FFN, a 49152-word logits layer); ``DEFAULT_IN_PLACE_ROWS``. Another CPU may move either crossover (an
Intel Xeon's L1 and L2 are other sizes and ways, its prefetchers others), so no constant decides it: the first
load on a machine times both paths on one thread, alternating, at 16 to 64 rows (``ROWS``), on a matrix of each
layout that streams from memory as a decode step's do (the copies together larger than L3), and keeps the limits
in ``$FASTDECODE_CACHE`` under a name keyed by the CPU model and the kernels' build (their sources, PyTorch
version and flags: a changed kernel is measured again). They become ``KernelChoice.in_place_rows``
(layers/products.py), an argument of every ``float_matmul`` call: never looked up while a product runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from .gemm_choice import cpu_model, machine_record_path, read_record, write_atomically

# (w's rows spread over L1's sets, w's rows in the same sets): in place up to these rows on AMD Zen 5 (packed copy ->
# in place, one thread, bart-base's decoder products streamed from memory, G multiply-adds/s: 32 rows 768 x 2304
# 59 -> 86, 768 x 3072 (rows 12 KiB apart) 60 -> 68; 64 rows 768 x 2304 74 -> 92, but 768 x 3072 74 -> 64, 48 rows
# 68 -> 63), fmatmul.h's ZEN5_IN_PLACE_ROWS; the limits where nothing is measured (no AVX-512: the AVX2 kernel has no
# packed path) and of reference KernelChoices.
DEFAULT_IN_PLACE_ROWS = (64, 32)
LIMITS = (8, 64)  # fmatmul.h: 8 (no 9+ rows in place) to MAX_IN_PLACE_ROWS
# The row counts timed; a limit is one of them, or 8. 28 as well: on the loaded Zen 5 with w's rows aliased, 768 x
# 3072 and 576 x 16384 ran in place 0.87-1.01x packed's time at 28 rows, 1.12-1.16x at 32 (one thread, medians of 10).
ROWS = (16, 24, 28, 32, 48, 64)
# A path wins a row count where it takes this factor less time than the other; nearer, the default's path (on the
# loaded 2-core Zen 5, the paired ratio of one row count moved by up to ~0.3 between runs where the paths are close:
# 32 rows with w's rows aliased, 0.85-1.21; medians of 5).
MARGIN = 1.1
# Per layout, (inputs, outputs): bart-base's Q/K/V (rows 9 KiB apart: spread) and fc1 (12 KiB apart: aliased).
SHAPES = {"spread": (768, 2304), "aliased": (768, 3072)}
REPETITIONS = 5
L3_FALLBACK = 32 << 20  # bytes, where sysfs does not say
MAX_COPIES = 16


def machine_in_place_rows() -> tuple[int, int]:
    """This machine's (spread, aliased) in-place row limits for ``float_matmul``: from the cache file, else measured
    (and written there); ``DEFAULT_IN_PLACE_ROWS`` without the AVX-512 float kernel (nothing to measure)."""
    from . import ops

    if not ops.available() or not ops.set_avx512():
        return DEFAULT_IN_PLACE_ROWS
    path = limits_path()
    record = read_record(path)
    limits = valid_limits(record.get("in_place_rows"))
    if limits is not None and record.get("procedure") == procedure():
        return limits
    # not measured with these kernels (or this procedure) here yet, or an unreadable file: measure
    ratios = time_in_place_rows()
    limits = tuple(chosen_limit(ratios[layout], default) for layout, default in zip(SHAPES, DEFAULT_IN_PLACE_ROWS))
    if path is not None:
        write_atomically(path, {"in_place_rows": list(limits), "in_place_over_packed": {
            layout: {str(rows): ratio for rows, ratio in by_rows.items()} for layout, by_rows in ratios.items()},
            "procedure": procedure(), "cpu": cpu_model()})
    return limits  # type: ignore[return-value]


def procedure() -> dict:
    """What the measurement times and how it decides, as its record holds it: a record made another way is measured
    again."""
    return {"rows": list(ROWS), "shapes": {layout: list(shape) for layout, shape in SHAPES.items()},
            "repetitions": REPETITIONS, "margin": MARGIN, "defaults": list(DEFAULT_IN_PLACE_ROWS)}


def valid_limits(value) -> tuple[int, int] | None:
    """``value`` as (spread, aliased) limits where it is two ints within ``LIMITS``, else None."""
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(type(v) is int and LIMITS[0] <= v <= LIMITS[1] for v in value)):
        return value[0], value[1]
    return None


def limits_path() -> Path | None:
    """The record's file, or None when the caches are off (then every load measures): keyed by the CPU model and
    the kernels' build (gemm_choice.machine_record_path)."""
    return machine_record_path("float-rows")


def chosen_limit(ratios: dict[int, float], default: int) -> int:
    """The in-place limit from each timed row count's in-place time over the packed one: the largest row count up
    to which in place wins every timed count (by ``MARGIN``, or within it where the default reads in place), or 8."""
    limit = LIMITS[0]
    for rows in sorted(ratios):
        if not (ratios[rows] * MARGIN <= 1 or (ratios[rows] < MARGIN and rows <= default)):
            break
        limit = rows
    return limit


def time_in_place_rows() -> dict[str, dict[int, float]]:
    """Per layout of ``SHAPES``, per row count of ``ROWS``: ``float_matmul``'s time in place over its time packed,
    the median of ``REPETITIONS`` pairs of calls one after the other (so that the machine's load, which drifts,
    hits both alike), on one thread (the calling thread's CPU time: a busy neighbour's turns do not count), each
    call on the next of enough copies of the matrix that it was evicted from L3 since its last use (a decode
    step's weights stream from memory). On the CPU whatever torch's default device (as gemm_choice's)."""
    import torch

    from . import ops

    generator = torch.Generator().manual_seed(0)
    forced = (LIMITS[1], LIMITS[1]), (LIMITS[0], LIMITS[0])  # every 9-64 rows in place; none
    ratios: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for layout, (inputs, outputs) in SHAPES.items():
            base = torch.rand(inputs, outputs, generator=generator, device="cpu") - 0.5  # [in, out], as the kernel reads
            copies = [base.clone() for _ in range(_copies(base.numel() * base.element_size()))]
            x = torch.rand(max(ROWS), inputs, generator=generator, device="cpu") - 0.5
            pair_ratios: dict[int, list[float]] = {rows: [] for rows in ROWS}
            for path in range(2):
                ops.float_matmul(x, copies[0], None, 1, *forced[path])  # warm-up: the packed path's buffer
            turn = 0
            for repetition in range(REPETITIONS):
                for rows in ROWS:
                    seconds = [0.0, 0.0]
                    for path in (0, 1) if repetition % 2 == 0 else (1, 0):  # either first by turns
                        weight, turn = copies[turn % len(copies)], turn + 1
                        start = time.thread_time()
                        ops.float_matmul(x[:rows], weight, None, 1, *forced[path])
                        seconds[path] = time.thread_time() - start
                    pair_ratios[rows].append(seconds[0] / max(seconds[1], 1e-9))
            ratios[layout] = {rows: sorted(values)[len(values) // 2] for rows, values in pair_ratios.items()}
            del copies
    return ratios


def _copies(matrix_bytes: int) -> int:
    """Copies of a matrix enough that the others evict one from L3 between its uses."""
    return min(MAX_COPIES, max(2, math.ceil(_l3_bytes() / matrix_bytes) + 1))


def _l3_bytes() -> int:
    """The L3 size sysfs gives cpu0 (a slice's where L3 is sliced: what one core's data can stay in), else
    ``L3_FALLBACK``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for cache in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (cache / "level").read_text().strip() == "3":
                text = (cache / "size").read_text().strip()
                return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (OSError, ValueError, IndexError, KeyError):
            break
    return L3_FALLBACK
