# One command each on a fresh machine: `make serve` runs the cluster, `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install chromium serve test lint format proto clean

install: $(STAMP)

# torch is installed first and alone, pinned, so no other package pulls another build. Which build pip finds
# depends on its index: PyPI's Linux wheel is the CUDA one (several GB). On a CPU-only machine pass
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to get the CPU build.
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m engine.kernels.build
	touch $(STAMP)

# The dashboard test drives Debian's chromium; the package manager needs root, so others are told.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
		echo "chromium is missing: run 'sudo apt-get install -y --no-install-recommends chromium'" \
			"(the dashboard browser test needs /usr/bin/chromium)" >&2; \
	fi

serve: install
	$(BIN)/bucketserve serve $(ARGS)

test: install chromium
	$(BIN)/pytest -q tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

proto: install
	$(BIN)/python -m proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
