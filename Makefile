# The two set-up commands of the README: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build of torch lies on disk on the project machines; pinning it keeps pip
# from pulling a multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: test demo lint test-vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	touch $@

test: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

demo: $(VENV)/.installed
	$(BIN)/moewire study

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) moewire-study .pytest_cache
