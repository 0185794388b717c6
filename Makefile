# Shortcuts for the README's two set-up commands (which need only python3), and the headline benchmark.
.PHONY: demo test bench

demo:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' && .venv/bin/relattn demo

test:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' && .venv/bin/python -m pytest -q

bench:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' && .venv/bin/relattn bench
