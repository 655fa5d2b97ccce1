# One command each on a fresh machine: `make serve` runs the cluster, `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint format proto clean

install: $(STAMP)

# torch is installed first and alone, pinned, so no other package can pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

serve: install
	$(BIN)/bucketserve serve $(ARGS)

test: install
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
