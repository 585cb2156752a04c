# The README's two commands: `make demo` and `make test`. Each creates or reuses .venv.
# torch==2.13.0 is installed FIRST: it is a CPU wheel on local disk; installing
# megatron-core into an environment without torch would pull a ~3 GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mindspeed_like-installed
export OMP_NUM_THREADS ?= 1
# The demo and tests time a CPU run; torch.compile's first-step compile would dominate.
export TORCHDYNAMO_DISABLE ?= 1

.PHONY: install demo test test-all test-compile lint megatron-lm-smoke clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mindspeed-like demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

# Every case, slow ones included (the compile lane is its own target).
test-all: $(STAMP)
	$(PY) -m pytest -q -m 'not compile'

# torch.compile ON, as users run megatron (its jit_fuser is torch.compile): every acceleration's
# GPT parity with megatron's compiled fusions, alone and together (tests marked `compile`).
test-compile: $(STAMP)
	TORCHDYNAMO_DISABLE=0 $(PY) -m pytest -q -m compile

lint: $(STAMP)
	$(VENV)/bin/ruff check mindspeed_like tests benchmarks examples
	$(VENV)/bin/ruff format --check mindspeed_like tests benchmarks examples

# Megatron-LM's own pretrain_gpt.py on CPU, every feature's opt-in test of it; needs a core_v0.16.1
# checkout (see docs/megatron-lm.md). megatron compiles its dataset helpers with the python3 on
# PATH: the venv's comes first.
megatron-lm-smoke: $(STAMP)
	@test -f "$(MEGATRON_LM_PATH)/pretrain_gpt.py" || \
		(echo "set MEGATRON_LM_PATH=/path/to/Megatron-LM (a checkout of tag core_v0.16.1)"; exit 2)
	$(PY) -m pip install -q -e '.[test,megatron-lm]'
	PATH="$(abspath $(VENV))/bin:$$PATH" MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" \
		$(PY) -m pytest -q -m '' tests/integration/test_megatron_lm_integration.py tests/features/*/test_*_megatron_lm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
