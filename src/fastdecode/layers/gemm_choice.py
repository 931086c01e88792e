"""Which float32 product prompt rows take on this machine: measured once, then read from a file.

PyTorch offers two exact float32 GEMMs on the CPU: MKL's sgemm (``F.linear``) and oneDNN's
(``torch.ops.mkldnn._linear_pointwise``, which can fuse ReLU / GELU). Which is faster depends on the
CPU and on the weights' layout, and the difference is not small: on the [out, in] views of the
contiguous [in, out] buffers the models hold (layers/linear.py), oneDNN ran 1.1-1.3x faster than MKL
on the AMD EPYC this project was first measured on, and 2.0-2.4x *slower* on the Intel Xeon of a
later session (a bart-base encoder over 8 x 256 tokens: 6.7 s of GEMMs against MKL's 3.4 s). So no
constant decides it: the first load on a machine times both on that layout (about a second, on
one thread, alternating) and keeps the answer in ``$FASTDECODE_CACHE`` (default
``~/.cache/fastdecode``) under a name keyed by the CPU model and the kernels' build (their sources, the PyTorch
version and flags: the float kernel takes part, below); later loads read the file (with
``FASTDECODE_CACHE=off``, every load measures). The choice becomes part of the
model's ``KernelChoice`` (layers/products.py): it is made at load and carried by every forward,
never looked up while a product runs. Both GEMMs are exact float32; their results differ only by
summation order (~1e-6).

The same measurement times the project's own float kernel (``float_matmul``, layers/fmatmul.cpp: the one
generated rows take) on the same products, and prompt rows of the float matrices it serves take it too
(``KernelChoice.prompt_kernel``) where it runs them within ``KERNEL_MARGIN`` of the faster GEMM. The margin is
what a one-thread contest cannot see: both GEMMs split a prompt's products over an OpenMP team, which on a
2-core machine spins beside the kernel thread pool that a serving step's generated rows and attention run on
(a ``perf`` of 16 float32 SmolLM2-135M prompts on 2 threads: torch's OpenMP worker in libgomp's spin ~19% of
the samples); on the kernel, a step's prompt and generated rows run on one pool.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

FLOAT_GEMMS = ("onednn", "mkl")  # KernelChoice.float_gemm (layers/products.py)
KERNEL = "kernel"  # the float kernel's entry in the timings
# Prompt rows take the kernel where its time is at most this many times the faster GEMM's (see above).
KERNEL_MARGIN = 1.1
# The timed products: 256 prompt rows through an attention projection and the two FFN products of a
# small model, on the layout the models hold (the ratio between the GEMMs varies with the shape: one
# shape alone can mislead).
ROWS = 256
SHAPES = ((1536, 1536), (768, 3072), (3072, 768))  # (inputs, outputs)
REPETITIONS = 3


def machine_float_choice() -> tuple[str, bool]:
    """(this machine's faster float32 GEMM, "onednn" or "mkl"; whether prompt rows of the float matrices the
    kernel serves take it): from the cache file, else measured (and written there). ("mkl", False) without
    oneDNN and the kernel, nothing to measure."""
    from . import ops

    if not ops.onednn_available() and not ops.available():
        return "mkl", False
    path = choice_path()
    record = read_record(path)
    choice, prompt_kernel = record.get("float_gemm"), record.get("prompt_kernel")
    if choice in FLOAT_GEMMS and isinstance(prompt_kernel, bool):
        return choice, prompt_kernel
    # not measured here yet (or an unreadable file, or one from before the kernel took part): measure
    timings = time_float_gemms()
    choice = min((name for name in FLOAT_GEMMS if name in timings), key=timings.get)
    prompt_kernel = KERNEL in timings and timings[KERNEL] <= KERNEL_MARGIN * timings[choice]
    if path is not None:
        write_atomically(path, {"float_gemm": choice, "prompt_kernel": prompt_kernel, "median_seconds": timings,
                                 "rows": ROWS, "shapes": [list(shape) for shape in SHAPES], "cpu": cpu_model()})
    return choice, prompt_kernel


def choice_path() -> Path | None:
    """The record's file, or None when the caches are off (then every load measures)."""
    return machine_record_path("float-gemm")


def machine_record_path(name: str) -> Path | None:
    """The file of a measurement named ``name`` made on this machine with these kernels (keyed by the CPU model and
    layers/kernels.py's build folder, named by the kernels' sources, the PyTorch version and flags), or None when
    the caches are off."""
    from .kernels import cache_folder, library_path

    root = cache_folder()
    key = hashlib.sha256(f"{cpu_model()}|{library_path().parent.name}".encode()).hexdigest()[:16]
    return None if root is None else root / f"{name}-{key}.json"


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
    """Each GEMM's (oneDNN's where PyTorch has it, MKL's) and the float kernel's (where the extension is built)
    summed median seconds over ``SHAPES``: [ROWS, in] x an [out, in] view of a contiguous [in, out] buffer (the
    kernel reads the buffer itself), one thread (the calling one: its CPU time), alternating (so a busy
    neighbour's use of the memory bus slows them alike). The operands are made on the CPU whatever torch's
    default device: a user's ``torch.set_default_device("cuda")`` made the CPU generator fail every load,
    and "meta" timed empty operations and cached a choice from them."""
    import torch
    import torch.nn.functional as F

    from . import ops

    generator = torch.Generator().manual_seed(0)
    total: dict[str, float] = {}
    present = {"onednn": ops.onednn_available(), "mkl": True, KERNEL: ops.available()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for inputs, outputs in SHAPES:
                x = torch.randn(ROWS, inputs, generator=generator, device="cpu")
                weight = torch.randn(inputs, outputs, generator=generator, device="cpu").t()  # [out, in] view, as linear.py
                bias = torch.randn(outputs, generator=generator, device="cpu")
                runs = {"onednn": lambda: ops.onednn_linear(x, weight, bias, "none", ""),
                        "mkl": lambda: F.linear(x, weight, bias),
                        # ROWS: past the in-place limits (at most 64)
                        KERNEL: lambda: ops.float_matmul(x, weight.t(), bias, 1, 64, 64)}
                runs = {name: run for name, run in runs.items() if present[name]}
                seconds: dict[str, list[float]] = {name: [] for name in runs}
                for run in runs.values():
                    run()  # warm-up: oneDNN builds its primitive on the first call
                for _ in range(REPETITIONS):
                    for name, run in runs.items():
                        start = time.thread_time()  # this thread's CPU time: a busy neighbour's turns do not count
                        run()
                        seconds[name].append(time.thread_time() - start)
                for name, values in seconds.items():
                    total[name] = total.get(name, 0.0) + sorted(values)[len(values) // 2]
    finally:
        torch.set_num_threads(threads)
    return total


def read_record(path: Path | None) -> dict:
    """A measurement's record as ``write_atomically`` left it, or {} where there is none to read (the caches off,
    not measured here yet, an unreadable file): the caller then measures."""
    if path is None:
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_atomically(path: Path, record: dict) -> None:
    """Write the record where concurrent first loads cannot see half a file (a failure is harmless:
    the next load measures again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record, indent=1))
        temporary.replace(path)
    except OSError:
        pass
