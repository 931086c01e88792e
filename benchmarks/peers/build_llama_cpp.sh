#!/usr/bin/env bash
# Build llama.cpp's llama-server (what quantized_speed.py and serve_load.py run) from the llama.cpp sources
# vendored in the llama-cpp-python sdist (PyPI), so the benchmarks can run llama.cpp on the same GGUF.
# About 15 minutes on 2 cores. Needs cmake, ninja (or make) and a C++17 compiler (Debian: cmake
# ninja-build g++). Usage:
#
#   benchmarks/peers/build_llama_cpp.sh [CACHE_DIR]     # default: ~/.cache/fastdecode-bench/llama.cpp
#
# The binaries land in CACHE_DIR/build/bin (or $BUILD_DIR/bin); the benchmarks find them there, or where
# --llama-cpp-bin or the LLAMA_CPP_BIN environment variable points. Running it again only rebuilds what
# changed, including the CPU backend when the CPU's instruction sets differ from the last build's.
# The benchmarked build: llama-cpp-python 0.3.36's vendored llama.cpp (libllama 0.5.0, ggml 0.25.3).
set -euo pipefail

CACHE_DIR="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/fastdecode-bench/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # the sdist whose vendored llama.cpp was benchmarked
PYTHON="${PYTHON:-python3}"
TARGETS=(${LLAMA_CPP_TARGETS:-llama-server})   # e.g. LLAMA_CPP_TARGETS="llama-server llama-bench"
JOBS="${JOBS:-$(nproc)}"

mkdir -p "$CACHE_DIR"
SOURCE="$CACHE_DIR/llama_cpp_python-$VERSION"
if [ ! -d "$SOURCE/vendor/llama.cpp" ]; then
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE_DIR/sdist"
  tar xzf "$CACHE_DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE_DIR"
fi

BUILD="${BUILD_DIR:-$CACHE_DIR/build}"

# The instruction sets of the CPU building it, named one by one rather than -march=native, but AMX
# off: -march=native turns on ggml's AMX kernels on a CPU that lists amx_int8, and on the 2-core Xeon
# of the benchmarks they die with SIGILL at their first `tilezero` (tinygemm_kernel_amx, while the
# server warms up). LLAMA_CPP_AMX=ON builds them anyway. Naming the sets also makes a cache built on
# another CPU recompile the CPU backend here. Elsewhere than x86-64 Linux: -march=native.
CPU_FLAGS=(-DGGML_NATIVE=ON)
AMX="${LLAMA_CPP_AMX:-OFF}"
if [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ]; then
  FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { case "$FLAGS" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
  CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)"
             -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)"
             -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
             -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
             -DGGML_AMX_TILE="$AMX" -DGGML_AMX_INT8="$AMX" -DGGML_AMX_BF16="$AMX")
fi

GENERATOR=(-G Ninja)
command -v ninja >/dev/null 2>&1 || GENERATOR=()
cmake -S "$SOURCE/vendor/llama.cpp" -B "$BUILD" "${GENERATOR[@]}" \
      -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$BUILD" --parallel "$JOBS" --target "${TARGETS[@]}"
for target in "${TARGETS[@]}"; do
  test -x "$BUILD/bin/$target" || { echo "missing $BUILD/bin/$target" >&2; exit 1; }
done
echo "llama.cpp binaries in $BUILD/bin"
