"""Which float32 GEMM prompt rows take on this machine: measured once, then read from a file.

PyTorch offers two exact float32 GEMMs on the CPU: MKL's sgemm (``F.linear``) and oneDNN's
(``torch.ops.mkldnn._linear_pointwise``, which can fuse ReLU / GELU). Which is faster depends on the
CPU and on the weights' layout, and the difference is not small: on the [out, in] views of the
contiguous [in, out] buffers the models hold (layers/linear.py), oneDNN ran 1.1-1.3x faster than MKL
on the AMD EPYC this project was first measured on, and 2.0-2.4x *slower* on the Intel Xeon of a
later session (a bart-base encoder over 8 x 256 tokens: 6.7 s of GEMMs against MKL's 3.4 s). So no
constant decides it: the first load on a machine times both on that layout (about a second, on
one thread, alternating) and keeps the answer in ``$FASTDECODE_CACHE`` (default
``~/.cache/fastdecode``) under a name keyed by the CPU model and the PyTorch version; later loads
read the file (with ``FASTDECODE_CACHE=off``, every load measures). The choice becomes part of the
model's ``KernelChoice`` (layers/products.py): it is made at load and carried by every forward,
never looked up while a product runs. Both GEMMs are exact float32; their results differ only by
summation order (~1e-6).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

FLOAT_GEMMS = ("onednn", "mkl")  # KernelChoice.float_gemm (layers/products.py)
# The timed products: 256 prompt rows through an attention projection and the two FFN products of a
# small model, on the layout the models hold (the ratio between the GEMMs varies with the shape: one
# shape alone can mislead).
ROWS = 256
SHAPES = ((1536, 1536), (768, 3072), (3072, 768))  # (inputs, outputs)
REPETITIONS = 3


def machine_float_gemm() -> str:
    """This machine's faster float32 GEMM ("onednn" or "mkl"): from the cache file, else measured
    (and written there). "mkl" when PyTorch has no oneDNN GEMM."""
    from . import ops

    if not ops.onednn_available():
        return "mkl"
    path = choice_path()
    try:
        if path is None:
            raise OSError("the caches are off")
        choice = json.loads(path.read_text())["float_gemm"]
        if choice in FLOAT_GEMMS:
            return choice
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured here yet (or an unreadable file): measure
    timings = time_float_gemms()
    choice = min(timings, key=timings.get)
    if path is not None:
        _write_atomically(path, {"float_gemm": choice, "median_seconds": timings, "rows": ROWS,
                                 "shapes": [list(shape) for shape in SHAPES], "cpu": cpu_model()})
    return choice


def choice_path() -> Path | None:
    """The record's file, or None when the caches are off (then every load measures)."""
    import torch

    from .kernels import cache_folder

    root = cache_folder()
    key = hashlib.sha256(f"{cpu_model()}|{torch.__version__}".encode()).hexdigest()[:16]
    return None if root is None else root / f"float-gemm-{key}.json"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's description elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def time_float_gemms() -> dict[str, float]:
    """Each GEMM's summed median seconds over ``SHAPES``: [ROWS, in] x an [out, in] view of a
    contiguous [in, out] buffer, one thread, the two alternating (so a busy neighbour slows both)."""
    import torch
    import torch.nn.functional as F

    from . import ops

    generator = torch.Generator().manual_seed(0)
    total = dict.fromkeys(FLOAT_GEMMS, 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for inputs, outputs in SHAPES:
                x = torch.randn(ROWS, inputs, generator=generator)
                weight = torch.randn(inputs, outputs, generator=generator).t()  # [out, in] view, as layers/linear.py holds
                bias = torch.randn(outputs, generator=generator)
                runs = {"onednn": lambda: ops.onednn_linear(x, weight, bias, "none", ""),
                        "mkl": lambda: F.linear(x, weight, bias)}
                seconds: dict[str, list[float]] = {name: [] for name in runs}
                for run in runs.values():
                    run()  # warm-up: oneDNN builds its primitive on the first call
                for _ in range(REPETITIONS):
                    for name, run in runs.items():
                        start = time.perf_counter()
                        run()
                        seconds[name].append(time.perf_counter() - start)
                for name, values in seconds.items():
                    total[name] += sorted(values)[len(values) // 2]
    finally:
        torch.set_num_threads(threads)
    return total


def _write_atomically(path: Path, record: dict) -> None:
    """Write the record where concurrent first loads cannot see half a file (a failure is harmless:
    the next load measures again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record, indent=1))
        temporary.replace(path)
    except OSError:
        pass
