# Shortcuts for the README's two set-up commands (which need only python3), and the headline benchmark.
.PHONY: demo test bench docs-images

demo:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' && .venv/bin/relattn demo

test:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' \
	  && .venv/bin/pip install -q -c constraints.txt --no-deps eole==0.6.4 \
	  && RELATTN_REQUIRE_EOLE=1 .venv/bin/python -m pytest -q

bench:
	python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[dev]' && .venv/bin/relattn bench

# The figures under docs/, redrawn from the run records beside them (docs/images.py says which).
docs-images:
	.venv/bin/python docs/images.py
