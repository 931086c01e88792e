"""The AVX2 extension (every ``layers/*.cpp``, with their ``*.h``): built once, then loaded from a cache.
Its AVX-512 + VNNI kernels (``*_avx512.cpp``) are in the same build and used at run time where the
CPU has them (``isa.h``; the same results bit for bit, ``set_avx512`` switches them).

``make install`` builds it (``python -m fastdecode.layers.kernels``) with the C++ compiler and
PyTorch's extension builder, into ``$FASTDECODE_CACHE`` (default ``~/.cache/fastdecode``) under a
name keyed by the source, PyTorch version and CPU flags, so a later process only loads the shared
library (milliseconds). ``qmatmul_op()`` returns None (and logs once why) where it cannot be had:
no AVX2/FMA/F16C, no compiler, another device. Callers then use the pure PyTorch path.
The ops have fake (meta) kernels, so ``torch.compile(fullgraph=True)`` traces it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("fastdecode")
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


def _cpu_has_avx2() -> bool:
    return _cpu_has("avx2", "fma", "f16c")


def cpu_has_avx512() -> bool:
    """Whether this CPU can run the AVX-512 VNNI kernels (isa.h's cpu_has_avx512, read without torch)."""
    return _cpu_has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


def _build_dir() -> Path:
    import torch

    text = b"".join(f.name.encode() + f.read_bytes() for f in SOURCES + HEADERS)
    key = hashlib.sha256(text + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    root = Path(os.environ.get("FASTDECODE_CACHE", Path.home() / ".cache" / "fastdecode"))
    return root / f"kernels-{key}"


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


_LOADED: dict[str, object] = {}  # "ops" -> torch.ops.fastdecode_kernels (or None): a dict torch.compile reads


def _ops():
    if "ops" not in _LOADED:
        _LOADED["ops"] = _load_ops()
    return _LOADED["ops"]


def qmatmul_op():
    """torch.ops.fastdecode_kernels.qmatmul, or None where the extension cannot be built or loaded."""
    ops = _ops()
    return None if ops is None else ops.qmatmul


def dequantize_op():
    """torch.ops.fastdecode_kernels.dequantize (codes -> float32 [N, K]), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.dequantize


def exact_qmatmul_op():
    """torch.ops.fastdecode_kernels.exact_qmatmul (prompt rows times a quantized weight's exact float32
    values, layers/exact_matmul.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.exact_qmatmul


def prompt_qmatmul_op():
    """torch.ops.fastdecode_kernels.prompt_qmatmul (int8 prompt rows times rows-layout 8-bit codes in groups
    of 16, Q6_K: layers/qprompt.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.prompt_qmatmul


def paged_attention_op():
    """torch.ops.fastdecode_kernels.paged_attention (one-query decode attention over a block pool,
    layers/attention.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.paged_attention


def beam_candidates_op():
    """torch.ops.fastdecode_kernels.beam_candidates (a beam search step's log-softmax, running scores and
    top candidates in one pass, layers/beam_search.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.beam_candidates


def cross_attention_op():
    """torch.ops.fastdecode_kernels.cross_attention (queries over each source's own keys, contiguous per
    head, layers/cross_attention.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.cross_attention


def float_matmul_op():
    """torch.ops.fastdecode_kernels.float_matmul (float32 x [M, K] @ w [K, N] + bias for generated rows,
    each output summed in one fixed order: layers/fmatmul.cpp), or None like ``qmatmul_op``."""
    ops = _ops()
    return None if ops is None else ops.float_matmul


def set_avx512(enabled: bool | None = None) -> bool:
    """Whether the kernels use AVX-512 + VNNI (layers/isa.h; the same results as AVX2, faster); ``enabled``
    switches them on (where the CPU has them) or off first. False without the extension."""
    ops = _ops()
    if ops is None:
        return False
    return bool(ops.set_avx512(-1 if enabled is None else int(enabled)))


def elementwise_ops():
    """torch.ops.fastdecode_kernels (its rms_norm, add_rms_norm, qkv_heads, gated: layers/elementwise.cpp),
    or None like ``qmatmul_op``."""
    return _ops()


class KernelOps:
    """The extension's ops by name, each its ``default`` overload: calling an OpOverload directly costs
    about 5.5 us against 9.4 us through the overload packet (``torch.ops.ns.op``), and a decode step
    calls about ten per layer. Resolved on first use, then a plain attribute."""

    def __init__(self, namespace) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        overload = getattr(self._namespace, name).default
        setattr(self, name, overload)
        return overload


def _load_ops():
    import torch

    if not _cpu_has_avx2():
        log.info("fastdecode: CPU without AVX2/FMA/F16C; quantized matmuls use the PyTorch fallback")
        return None
    try:
        library = _build_dir() / "fastdecode_kernels.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            log.warning("fastdecode: building the quantized kernels (once, about a minute)")
            # cpp_extension.load registers the ops itself; loading again is a no-op then, and needed when
            # another process finished the build while this one waited for the lock (build() returns early).
            torch.ops.load_library(str(build()))
        _register_fake()
        return KernelOps(torch.ops.fastdecode_kernels)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        log.warning("fastdecode: quantized kernels unavailable (%s); using the PyTorch fallback", exc)
        return None


def _outputs(codes, scale, outputs: int) -> int:
    """N of a quantized weight's op arguments: rows of scale [N, K/G], or ``outputs`` of a tiled weight
    (codes [N/8 rounded up, K/32, bytes], the last tile padded; -1: every tile's 8 rows)."""
    if codes.dim() == 2:
        return scale.shape[0]
    return outputs if outputs >= 0 else scale.shape[0] * scale.shape[2]


def _register_fake() -> None:
    """The op's shape function (a "fake" kernel): torch.compile / FakeTensor tracing run it instead of
    the C++ code, so a compiled decode step (fullgraph) traces through quantized products."""
    import torch

    @torch.library.register_fake("fastdecode_kernels::qmatmul")
    def _qmatmul_fake(x, codes, scale, mins, bits, group, threads, activation_bits=8, outputs=-1,
                      bias=None):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], _outputs(codes, scale, outputs)))

    @torch.library.register_fake("fastdecode_kernels::exact_qmatmul")
    def _exact_qmatmul_fake(x, codes, scale, mins, bits, group, threads, outputs=-1):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], _outputs(codes, scale, outputs)))

    @torch.library.register_fake("fastdecode_kernels::prompt_qmatmul")
    def _prompt_qmatmul_fake(x, codes, scale, threads):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("fastdecode_kernels::dequantize")
    def _dequantize_fake(codes, scale, mins, bits, group, threads, outputs=-1):  # -> float32 [N, K]
        return scale.new_empty((_outputs(codes, scale, outputs), scale.shape[1] * group), dtype=torch.float32)

    @torch.library.register_fake("fastdecode_kernels::paged_attention")
    def _paged_attention_fake(q, keys, values, k_new, v_new, write_slots, table, key_start, positions, block, window,
                              scale, bias):  # q [B, H, D] -> [B, H, D] (keys, values written in place)
        return q.new_empty(q.shape)

    @torch.library.register_fake("fastdecode_kernels::beam_candidates")
    def _beam_candidates_fake(logits, running, banned, K, keep, threads=1):  # [B*K, V] -> scores, indices [B, keep]
        B = logits.shape[0] // K
        return logits.new_empty((B, keep)), logits.new_empty((B, keep), dtype=torch.long)

    @torch.library.register_fake("fastdecode_kernels::cross_attention")
    def _cross_attention_fake(q, keys, values, lengths, scale, threads=1):  # q [B, H, T, D] -> [B, H, T, D]
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastdecode_kernels::float_matmul")
    def _float_matmul_fake(x, weight, bias, threads):  # x [M, K] @ weight [K, N] -> [M, N]
        return x.new_empty((x.shape[0], weight.shape[1]))

    @torch.library.register_fake("fastdecode_kernels::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastdecode_kernels::add_rms_norm")
    def _add_rms_norm_fake(x, delta, delta_weight, weight, eps):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("fastdecode_kernels::qkv_heads")
    def _qkv_heads_fake(qkv, num_heads, num_kv_heads, norm_weight, eps, cos, sin):  # [B, T, (H + 2 Hkv) D]
        B, T, width = qkv.shape
        D = width // (num_heads + 2 * num_kv_heads)
        return (qkv.new_empty((B, num_heads, T, D)), qkv.new_empty((B, num_kv_heads, T, D)),
                qkv.new_empty((B, num_kv_heads, T, D)))  # q [B, H, T, D], k and v [B, Hkv, T, D]

    @torch.library.register_fake("fastdecode_kernels::gated")
    def _gated_fake(gate_up, activation):  # [..., 2I] -> [..., I]
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv))
