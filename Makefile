# One-command set-up: every target that needs Python creates .venv first when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slimwise-installed
export WANDB_MODE ?= disabled
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: venv test test-fast test-dist demo clean

venv: $(STAMP)

# torch first and pinned, so no later install can pull a different (CUDA) build.
$(STAMP): pyproject.toml scripts/build_llama_cpp.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	@echo "building DeepSpeed's CPU shared-memory op once (30-90 s; cached in $(TORCH_EXTENSIONS_DIR), loaded from there by every launch)"
	DS_ACCELERATOR=cpu $(PY) -c "from slimwise_train.distill.engine import prepare_shm_op; print('shm op:', prepare_shm_op())" > .venv/ds-shm-build.log 2>&1 || (tail -20 .venv/ds-shm-build.log; exit 1)
	@echo "building llama.cpp (libllama + llama-server, for slimwise_train.serve) once per CPU kind: about 5-10 min on 2 cores"
	bash scripts/build_llama_cpp.sh $(PY)
	touch $(STAMP)

# The test command CI runs: fast CPU unit tests plus the multi-process gloo tests.
test: $(STAMP)
	$(PY) -m pytest -q

# In-process tests only: no multi-process (dist), slow or child-process (subprocess: CLI runs, torchrun) tier.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not dist and not slow and not subprocess"

# The multi-process gloo tier alone.
test-dist: $(STAMP)
	$(PY) -m pytest -q -m dist

demo: $(STAMP)
	$(PY) scripts/demo.py

clean:
	rm -rf outputs multirun .pytest_cache
