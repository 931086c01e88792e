"""The AVX2 extension (every ``layers/*.cpp``, with their ``*.h``): built once, then loaded from a cache.
Its AVX-512 + VNNI kernels (``*_avx512.cpp``) are in the same build and used at run time where the
CPU has them (``isa.h``; the same results bit for bit, ``set_avx512`` switches them).

``make install`` builds it (``python -m fastdecode.layers.kernels``) with the C++ compiler and
PyTorch's extension builder, into ``$FASTDECODE_CACHE`` (default ``~/.cache/fastdecode``) under a
name keyed by the source, PyTorch version and CPU flags, so a later process only loads the shared
library (milliseconds). Loading it and calling its ops is ``layers/ops.py``'s job, the only module
that touches them.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# One shared library from every C++ source here: qmatmul.cpp defines the op library
# (TORCH_LIBRARY(fastdecode_kernels)), the other sources add to it (TORCH_LIBRARY_FRAGMENT).
SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]  # no fused mul+add: bitwise row results


def _cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every flag (False where it cannot be read). Imports nothing heavy."""
    try:
        listed = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in listed for flag in flags)


def cpu_has_avx2() -> bool:
    return _cpu_has("avx2", "fma", "f16c")


def cpu_has_avx512() -> bool:
    """Whether this CPU can run the AVX-512 VNNI kernels (isa.h's cpu_has_avx512, read without torch)."""
    return _cpu_has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


def cache_setting() -> str:
    """``$FASTDECODE_CACHE``, the folder of the project's caches (default ``~/.cache/fastdecode``): the
    kernels' build, the weight and tokenizer caches, the float GEMM choice; "off" turns the last three
    off (``cache_folder``)."""
    return os.environ.get("FASTDECODE_CACHE", str(Path.home() / ".cache" / "fastdecode"))


def cache_folder() -> Path | None:
    """The caches' folder, or None when ``$FASTDECODE_CACHE`` is "off"."""
    setting = cache_setting()
    return None if setting == "off" else Path(setting)


def _build_dir() -> Path:
    import torch

    text = b"".join(f.name.encode() + f.read_bytes() for f in SOURCES + HEADERS)
    key = hashlib.sha256(text + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return Path(cache_setting()) / f"kernels-{key}"


def library_path() -> Path:
    """Where this source tree's build of the extension lives (whether built yet or not)."""
    return _build_dir() / "fastdecode_kernels.so"


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache (a no-op when it is there); returns the library path."""
    from torch.utils import cpp_extension

    import fcntl

    directory = _build_dir()
    library = directory / "fastdecode_kernels.so"
    if library.exists():
        return library
    directory.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time, under a lock the kernel drops when its process dies. torch's own
    # ``lock`` file in the build folder is not: a build killed mid-way leaves it behind and the next
    # build would wait on it forever. Holding ours, any such file is stale, so it is removed.
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            directory.mkdir(exist_ok=True)
            (directory / "lock").unlink(missing_ok=True)
            # the `ninja` the venv installed, even when the venv is not activated
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            cpp_extension.load(name="fastdecode_kernels", sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS,
                               build_directory=str(directory), is_python_module=False, verbose=verbose)
    return library


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv))
