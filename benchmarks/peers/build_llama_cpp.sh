#!/usr/bin/env bash
# Build llama.cpp's llama-server (what quantized_speed.py and serve_load.py run) from the llama.cpp sources
# vendored in the llama-cpp-python sdist (PyPI), so the benchmarks can run llama.cpp on the same GGUF.
# About 15 minutes on 2 cores. Needs cmake, ninja (or make) and a C++17 compiler (Debian: cmake
# ninja-build g++). Usage:
#
#   benchmarks/peers/build_llama_cpp.sh [CACHE_DIR]     # default: ~/.cache/fastdecode-bench/llama.cpp
#
# The binaries land in CACHE_DIR/build/bin; the benchmarks find them there, or where --llama-cpp-bin
# or the LLAMA_CPP_BIN environment variable points. Running it again only rebuilds what changed.
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

GENERATOR=(-G Ninja)
command -v ninja >/dev/null 2>&1 || GENERATOR=()
cmake -S "$SOURCE/vendor/llama.cpp" -B "$CACHE_DIR/build" "${GENERATOR[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$CACHE_DIR/build" --parallel "$JOBS" --target "${TARGETS[@]}"
for target in "${TARGETS[@]}"; do
  test -x "$CACHE_DIR/build/bin/$target" || { echo "missing $CACHE_DIR/build/bin/$target" >&2; exit 1; }
done
echo "llama.cpp binaries in $CACHE_DIR/build/bin"
