# `make demo` and `make test` set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.plait-installed

.PHONY: demo test test-slow bench setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# Keep an importable torch; otherwise take the pinned CPU build (no CUDA download).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -c tests/pytest.ini -q -m "not slow" tests $(PYTEST_ARGS)

# The model suite's libraries (the `suite` extra) for the slow tier: torchvision made for the
# torch in place and without its dependencies first (PyPI's would bring another torch).
SUITE_STAMP := $(VENV)/.plait-suite-installed
$(SUITE_STAMP): $(STAMP)
	$(PY) -m pip install --no-deps "torchvision==0.$$(( $$($(PY) -c 'import torch; print(torch.__version__.split(".")[1])') + 15 )).*"
	$(PY) -m pip install -e ".[suite]"
	touch $(SUITE_STAMP)

# The heavy sweeps `make test` leaves out (tests marked slow, the model suite); CI runs both.
test-slow: $(SUITE_STAMP)
	PLAIT_SUITE_REQUIRED=1 $(PY) -m pytest -c tests/pytest.ini -q -m slow tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
