# Two entry points for a fresh machine with only python3: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/relattn demo

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/relattn bench --quick
