# The one entry point for set-up, tests, the demo and benchmarks. `make test` works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed compiles its CPU ops (CPUAdam) on first use; keep them so tests pay once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
export PYTHONUNBUFFERED := 1
# The venv's tools first (its ninja, not the system's: their build logs disagree and force rebuilds).
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: venv ops constraints lint docs test test-fast demo bench bench-big bench-gpu gpu-kit gpu-check gpu-check-dry schemas presets clean

# Processes for the demo: GPUs on a GPU machine, CPU processes (gloo) otherwise.
DEMO_PROCS ?= 2

# Every version the tests run with, resolved by pip-tools from setup.cfg's ranges and requirements/ci.in
# (`make constraints` refreshes it); users' own installs keep the ranges.
CONSTRAINTS := requirements/constraints.txt

# torch first, the CPU build (an unpinned torch pulls the CUDA wheels), then DeepSpeed built against it: all that
# DeepSpeed's CPU ops need, so that `make -j2` compiles them while pip installs the rest.
$(VENV)/.deepspeed: $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) pip setuptools wheel
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-build-isolation deepspeed
	touch $@

$(VENV)/.installed: $(VENV)/.deepspeed setup.cfg pyproject.toml
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[train,hf,test,lint,docs]'
	touch $@

venv: $(VENV)/.installed

# DeepSpeed's CPU ops (CPU Adam, fused Adam, and the shared-memory all-reduce, which distsetup's trainer leaves out
# but the tests' HF Trainer and Accelerate programs build), compiled at set-up rather than by whichever test first
# needs them; a no-op once built.
ops: $(VENV)/.deepspeed
	$(PY) -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder as A, FusedAdamBuilder as F, ShareMemCommBuilder as S; [b().load(verbose=False) for b in (A, F, S)]"

constraints: venv
	$(PY) -m pip install -q pip-tools
	CUSTOM_COMPILE_COMMAND="make constraints" $(VENV)/bin/pip-compile --quiet --upgrade --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
		--extra train --extra hf --extra test --extra lint --extra docs --pip-args "--no-build-isolation" \
		--output-file $(CONSTRAINTS) setup.cfg requirements/ci.in

# Lint in CI (`make -j2 lint docs test`, beside the ops' compile): ruff's rules and format, then mypy's types.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or anchor and on a page
# missing from the nav. The command reference, the run config's keys and the benchmark tables are generated.
docs: venv
	$(VENV)/bin/mkdocs build --strict

# The whole suite (under 20 minutes on 2 cores); test-fast is its in-process tier, tests/unit/ (tests/processes/
# starts torchrun, deepspeed, sbatch), and takes under 3 minutes. Three pytest-xdist workers on 2 cores: a test that
# starts processes waits on their start-up and their collectives as much as it computes, and a third worker fills
# those waits (docs/development.md has the times); the in-process tier computes only: two workers. A test module
# stays on one worker (tests/conftest.py says why).
TEST_WORKERS ?= 3
FAST_TEST_WORKERS ?= 2
XDIST := --dist loadfile
test: venv ops
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(XDIST)

test-fast: venv
	$(PY) -m pytest -q -n $(FAST_TEST_WORKERS) $(XDIST) tests/unit

# The README's main job: a ZeRO-2 config and a launcher for this machine, then the run itself.
demo: venv
	$(VENV)/bin/distsetup deepspeed --zero_stage 2 --micro_batch_size 8 --world_size $(DEMO_PROCS) \
		--optimizer none --output config/ds_config.json
	$(VENV)/bin/distsetup launcher --config config/config.yaml --use_deepspeed \
		--deepspeed_config config/ds_config.json --num_gpus_per_node $(DEMO_PROCS) --output scripts/run_training.sh
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/run_training.sh training.output_dir=runs/demo --no_resume

# Benchmarks 1-3, the loss memory, memory per rank at scale and the peers (about 50 minutes on 2 cores); each appends its table to benchmarks/RESULTS.md.
bench: venv
	cd benchmarks && ../$(PY) cli_latency.py && ../$(PY) train_overhead.py && ../$(PY) memory.py && ../$(PY) data_memory.py && ../$(PY) loss_memory.py && ../$(PY) scale_memory.py && ../$(PY) peers.py

# Benchmark 8: a 0.8B model on 8 CPU processes under FSDP2 and ZeRO-3 (a fresh GPT, a Llama from safetensors; about
# 20 minutes on 2 cores and 24 GiB).
bench-big: venv
	cd benchmarks && ../$(PY) big_model.py

# Benchmark 4, on a machine with a CUDA GPU and a CUDA build of torch: tokens/s and MFU of a 1B model.
bench-gpu: venv
	cd benchmarks && ../$(PY) gpu_throughput.py

# The GPU check (gpu/): `make gpu-kit` here fills .whl/ with the wheels a lent GPU machine lacks (it reaches no
# registry); there, `make gpu-check OUT=folder` (or `python3 gpu/check.py folder` where make is missing) installs them
# and measures everything in about 8 minutes; `make gpu-check-dry` runs the same stages here on the CPU.
OUT ?= gpu-check-out
KIT ?= .whl
gpu-kit: venv
	$(PY) gpu/kit.py --dest $(KIT)

gpu-check:
	$(PYTHON) gpu/check.py $(OUT)

gpu-check-dry: venv ops
	$(PY) gpu/dry_run.py $(OUT)

schemas: venv
	$(PY) -m distsetup.formats.runconfig > distsetup/formats/schemas/run_config.schema.json

presets: venv
	for p in zero0 zero1 zero2 zero2_offload zero3 zero3_offload; do \
		$(VENV)/bin/distsetup deepspeed --preset $$p --output config/presets/$$p.json; done

clean:
	rm -rf $(VENV) .torch_extensions build dist *.egg-info .pytest_cache site
