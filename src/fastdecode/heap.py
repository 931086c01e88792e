"""The C heap's handling of a forward's big activations: freed buffers kept for the next layer.

A prompt's forward allocates and frees the same large buffers layer after layer (Qwen2.5-Coder-1.5B at
512 rows: a 36 MB gate/up output, an 18 MB gated one; SmolLM2-135M: 1-6 MB each). glibc's malloc serves
a request above its mmap threshold (dynamic, at most 32 MB) with fresh pages from the kernel, and gives
the top of its heap back once more than its trim threshold (twice the mmap threshold) lies free there, so
every layer faulted its buffers' pages in again, each one zeroed by the kernel: 8-10% of a 512-token
prompt's CPU time on both models (sys 0.29-0.39 s of 3.9 s for Qwen, 0.04-0.06 of 0.6 s for SmolLM2, one
thread on an AMD EPYC Zen 5; 150,000-190,000 minor faults per Qwen prompt, 9,000-12,000 after).

``keep_freed_buffers()`` raises both thresholds once per process (``load`` and ``from_hf`` call it):
requests up to MMAP_THRESHOLD come from the heap, and up to TRIM_THRESHOLD of freed memory stays at its top
for the next layer and the next step. The memory a prompt used stays with the process after it; the peak
resident memory of the language-model benchmarks did not grow (the embedded model's batch-1 run 415-426 MB
either way; `qwen_coder_speed.py`'s peaks 391 MB and 1,401 MB, against 413 and 1,449 before). ``load_speech``
leaves glibc as it is: a Whisper process's encoder and decoder buffers of many sizes then fragmented the heap,
base's peak 120-210 MiB higher (805 against 685 MiB int8, 1,107 against 896 float32) for 4-16% of speed. Not applied where the
user chose malloc's settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a
``glibc.malloc`` tunable in ``GLIBC_TUNABLES``), where ``FASTDECODE_HEAP=default``, or off glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD = 128 << 20  # requests up to this size from the heap
TRIM_THRESHOLD = 256 << 20  # free memory kept at the heap's top
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache  # once per process
def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds once per process -> whether they are raised (see the module)."""
    return _user_allows() and _set_thresholds()


def _user_allows() -> bool:
    if os.environ.get("FASTDECODE_HEAP") == "default" or any(name in os.environ for name in _USER_SETTINGS):
        return False
    return "glibc.malloc" not in os.environ.get("GLIBC_TUNABLES", "")


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mmap first: setting it also fixes the trim threshold's dynamic adjustment, which the second call sets
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
