# graphopt: `make run` optimizes a sample model, `make test` runs the tests, `make lint` checks style and types,
# `make ci` runs what CI runs (.ci/run).
# Every target creates .venv and installs the package (with its dev tools) on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: install run test test-all lint ci bench samples clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

samples: $(STAMP)
	$(PY) samples/build_samples.py

run: samples
	$(VENV)/bin/graphopt run samples/tiny_encoder.onnx -o samples/tiny_encoder.opt.onnx --report samples/report.json
	@echo "optimized model: samples/tiny_encoder.opt.onnx   report: samples/report.json"

# The default suite, then the timed tests apart (they assert wall times; coverage's tracer would triple them).
# COV: extra pytest options for the default suite (.ci/run passes coverage's).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow and not timed" $(COV)
	$(PY) -m pytest -q -n 2 -m timed

# The slow suites too (the whole ONNX node test suite through the default pipeline).
test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check graphopt tests benchmarks samples
	$(VENV)/bin/ruff format --check graphopt tests benchmarks samples
	$(VENV)/bin/mypy graphopt

# What CI runs, from this checkout: .ci/run is the one definition.
ci:
	bash .ci/run

# The bytecode first: pip compiles an installed package's, as the peers' were, but not an editable install's, and
# where PYTHONDONTWRITEBYTECODE is set every timed run compiled graphopt's lazily imported modules again (bert_small:
# 0.34 s file to file, 0.32 s compiled).
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m compileall -q graphopt
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache samples/*.onnx samples/*.json
