# The one entry point for set-up, tests, the demo and benchmarks. `make test` works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed compiles its CPU ops (CPUAdam) on first use; keep them so tests pay once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
export PYTHONUNBUFFERED := 1

.PHONY: venv test test-fast demo bench schemas presets clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned (an unpinned torch pulls the CUDA wheels), then DeepSpeed against it.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) -m pip install -q -e '.[train,hf,test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m 'not slow'

schemas: venv
	$(PY) -m distsetup.runconfig > distsetup/schemas/run_config.schema.json

presets: venv
	for p in zero0 zero1 zero2 zero2_offload zero3 zero3_offload; do \
		$(VENV)/bin/distsetup deepspeed --preset $$p --output config/presets/$$p.json; done

clean:
	rm -rf $(VENV) .torch_extensions build dist *.egg-info .pytest_cache
