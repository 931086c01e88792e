"""fastdecode/heap.py: a freed big buffer's pages serve the next one (no kernel page faults for a layer's
activations), unless the user chose malloc's settings. Each case runs in a fresh process: the thresholds are
process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

# Allocates, writes and frees a 48 MB buffer three times (a layer's activation, step after step) and prints
# whether the thresholds were raised and the minor page faults of the second and third rounds.
ROUNDS = """
import ctypes, resource, sys
from fastdecode.heap import keep_freed_buffers
applied = keep_freed_buffers() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, faults = 48 << 20, []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, faults[1], faults[2])
"""
PAGES = (48 << 20) // 4096


def _rounds(mode: str, **env: str) -> tuple[str, int, int]:
    environment = {k: v for k, v in os.environ.items() if k not in ("FASTDECODE_HEAP", "GLIBC_TUNABLES")
                   and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], env={**environment, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


def test_a_freed_big_buffer_serves_the_next_without_page_faults():
    applied, second, third = _rounds("tune")
    assert applied == "True"
    assert second < PAGES // 10 and third < PAGES // 10, (second, third)


def test_glibc_defaults_fault_every_round_in_again():
    """The cost the tuning removes: without it each round's pages come fresh from the kernel."""
    _, second, third = _rounds("plain")
    assert second > PAGES // 2 and third > PAGES // 2, (second, third)


@pytest.mark.parametrize("env", [{"FASTDECODE_HEAP": "default"}, {"MALLOC_TRIM_THRESHOLD_": "1000000"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1000000"}])
def test_the_users_malloc_settings_are_left_alone(env):
    applied, _, _ = _rounds("tune", **env)
    assert applied == "False"
