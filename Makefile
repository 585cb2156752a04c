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

.PHONY: install demo test test-all test-compile test-isa test-cuda lint bench bench-gpu docs megatron-lm-smoke megatron-lm-smoke-versions test-megatron-lm-flags test-megatron-unit test-megatron-unit-8-ranks test-megatron-unit-ci megatron-bridge-smoke mbridge-smoke ms-swift-smoke test-versions clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mindspeed-like demo --optimization-level 2 --compare-steps 6 $(DEMO_ARGS)

# TEST_WORKERS pytest-xdist processes (one file each at a time: --dist loadfile keeps a file's
# module fixtures in one process). Most single-process tests use one core (OMP_NUM_THREADS=1), so
# two workers on a 2-core host took the default lane from 953 s to 618 s; TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# Every case, slow ones included (the compile lane is its own target).
test-all: $(STAMP)
	$(PY) -m pytest -q -m 'not compile' $(XDIST)

# torch.compile ON, as users run megatron (its jit_fuser is torch.compile): every acceleration's
# GPT parity with megatron's compiled fusions, alone and together (tests marked `compile`).
test-compile: $(STAMP)
	TORCHDYNAMO_DISABLE=0 $(PY) -m pytest -q -m compile

# The CPU-ISA lane: the kernel and feature tests again with torch and oneDNN held to AVX2 and to no
# vector ISA (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), each with a header that shows what ATen,
# oneDNN, Inductor and the bf16 GEMM probe really run at (mindspeed_like/testing/isa_lane.py).
test-isa: $(STAMP)
	$(PY) -m mindspeed_like.testing.isa_lane $(ISA_LANE_ARGS)

# The CUDA lane (tests/cuda): every acceleration's kernels against float64 and its GPT parity with
# megatron's own path on one GPU, torch.compile on as users run (under ~2.5 min on an H100); without
# a GPU its tests are skipped with the reason. LANE_DEVICE=cpu runs the same lane on the CPU (the
# self-check of the lane's logic). Its record (device name, versions, every test's outcome and each
# parity case's measured difference) goes to LANE_RECORD, a JUnit report to build/. On a GPU machine
# without make or .venv: `TORCHDYNAMO_DISABLE=0 MINDSPEED_LIKE_TEST_DEVICE=cuda
# MINDSPEED_LIKE_LANE_RECORD=results/test-cuda.json python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/cuda`.
LANE_DEVICE ?= cuda
LANE_RECORD ?= results/test-cuda$(if $(filter cpu,$(LANE_DEVICE)),-cpu).json
test-cuda: $(STAMP)
	TORCHDYNAMO_DISABLE=0 MINDSPEED_LIKE_TEST_DEVICE=$(LANE_DEVICE) MINDSPEED_LIKE_LANE_RECORD=$(LANE_RECORD) \
		$(PY) -m pytest -q -rs -p no:cacheprovider -m cuda tests/cuda --junitxml=build/test-cuda-$(LANE_DEVICE).xml

# The numbers the docs quote: each benchmark below writes results/<name>.json (its record: command,
# versions, host with the load average at start, every figure, each repeat's raw seconds) in the
# mode the docs quote, torch.compile on as users run megatron; `make docs` renders the docs' tables
# from results/ (results/ is committed, so `make docs` alone works on a fresh clone).
# The set and its durations: benchmarks/bench_set.txt (BENCH_SET=file for another list). Run it on
# an idle machine: each record says the load average at its start.
BENCH_SET ?= benchmarks/bench_set.txt
bench: $(STAMP)
	@set -e; start=$$(date +%s); \
	while IFS= read -r cmd; do \
		case "$$cmd" in ''|'#'*) continue ;; esac; \
		echo "== $$cmd (load $$(cut -d' ' -f1 /proc/loadavg))"; t=$$(date +%s); \
		TORCHDYNAMO_DISABLE=0 $(PY) $$cmd < /dev/null; \
		echo "== $$(( $$(date +%s) - t )) s: $$cmd"; \
	done < $(BENCH_SET); \
	echo "== make bench: $$(( $$(date +%s) - start )) s"

# The GPU figures the docs render beside the CPU ones: one prepared run of ~8 minutes on one H100
# (benchmarks/bench_gpu.py: compare presets with model FLOP utilisation, fused ops vs Liger-Kernel,
# attention vs torch's SDPA kernels, the optimizer step, Megatron-LM's pair), records to
# results/<name>-cuda.json. No venv needed (none is built): BENCH_GPU_PY is the python with torch,
# megatron-core (and liger-kernel) importable; MEGATRON_LM_PATH for the pair. A smoke run of every
# item at tiny sizes on this CPU: `benchmarks/bench_gpu.sh .venv/bin/python "" --smoke`.
BENCH_GPU_PY ?= python3
bench-gpu:
	benchmarks/bench_gpu.sh $(BENCH_GPU_PY) results $(BENCH_GPU_ARGS)

# The docs' numeric tables and quoted figures, re-rendered from results/ (`--check`: `make test`'s
# tests/docs/test_doc_tables.py does the same comparison and names a hand-edited row).
docs: $(STAMP)
	$(PY) -m mindspeed_like.plan.accuracy --record > /dev/null
	$(PY) -m mindspeed_like.plan.fit_check --record > /dev/null
	$(PY) -m mindspeed_like.plan.megatron_lm_check --record > /dev/null
	$(PY) -m mindspeed_like.plan.accuracy --device cuda --record > /dev/null
	$(PY) -m mindspeed_like.plan.megatron_lm_device_check --record > /dev/null
	$(PY) -m mindspeed_like.toolkit.doc_tables

lint: $(STAMP)
	$(VENV)/bin/ruff check mindspeed_like tests benchmarks examples
	$(VENV)/bin/ruff format --check mindspeed_like tests benchmarks examples

# The suite against other megatron-core releases, each in its own venv (.venv-mc<version>): the
# oldest supported and the newest release, a representative subset each (the primary, 0.16.1,
# what pip picks on Python 3.11, runs the whole suite in `make test`, which .ci/run calls first;
# TEST_PRIMARY=1 adds it here too). megatron-core 0.17+ declare Python >= 3.12 but run on 3.11:
# they are installed with --ignore-requires-python, a TESTING DEVICE only (torch's CPU wheel here
# is for 3.11); a Python 3.12 user gets them from a plain `pip install` (docs/versions.md).
# megatron-core goes in --no-deps after torch (0.13-0.15 declare numpy<2 yet run with numpy 2;
# 0.18+ import triton at `import megatron.core` without declaring it).
PRIMARY_VERSION := 0.16.1
TEST_VERSIONS ?= 0.13.1 0.19.2
# The subset: the declared targets and the audit, every feature's parity tests on the real model,
# the CPU adapter, the fixes, the specs and the integration tests (not the kernel-only tests,
# which do not touch megatron-core), the DistributedOptimizer resume in each version's formats, and the
# plan's byte counts against each version's real model, schedule functions and report_theoretical_memory, and
# the FSDP2 paths and HSDP with experts (which differ by release).
VERSION_TESTS ?= tests/features tests/adapters tests/fixes tests/integration tests/config tests/engine tests/te_backend tests/te_shim \
	tests/reliability/test_distopt_checkpoint_resume.py tests/plan tests/fsdp/test_megatron_fsdp_hsdp_experts.py \
	tests/fsdp/test_fsdp2_config.py tests/fsdp/test_torch_fsdp2.py
VERSION_PYTEST_ARGS ?= -q -p no:cacheprovider

.venv-mc%/.installed: pyproject.toml setup.py
	test -x .venv-mc$*/bin/python || $(PYTHON) -m venv .venv-mc$*
	.venv-mc$*/bin/python -m pip install -q --upgrade pip
	.venv-mc$*/bin/python -m pip install -q torch==2.13.0
	.venv-mc$*/bin/python -m pip install -q --no-deps --ignore-requires-python megatron-core==$*
	.venv-mc$*/bin/python -m pip install -q numpy packaging wrapt einops pyyaml pytest ruff psutil pybind11
	case "$*" in 0.1[3-7].*) ;; *) .venv-mc$*/bin/python -m pip install -q triton ;; esac
	.venv-mc$*/bin/python -m pip install -q --no-deps -e .
	touch $@

test-versions: $(foreach v,$(TEST_VERSIONS),.venv-mc$(v)/.installed) $(if $(TEST_PRIMARY),$(STAMP))
	@set -e; for v in $(TEST_VERSIONS); do \
		echo "== megatron-core $$v (subset: $(VERSION_TESTS))"; \
		start=$$(date +%s); \
		.venv-mc$$v/bin/python -m pytest $(VERSION_PYTEST_ARGS) $(VERSION_TESTS); \
		echo "== megatron-core $$v: $$(( $$(date +%s) - start )) s"; \
	done
	@if [ -n "$(TEST_PRIMARY)" ]; then \
		echo "== megatron-core $(PRIMARY_VERSION) (primary, whole suite)"; $(PY) -m pytest $(VERSION_PYTEST_ARGS); \
	fi

# Megatron-LM's own pretrain_gpt.py on CPU, every feature's opt-in test of it; needs a core_v0.16.1
# checkout (see docs/megatron-lm.md). megatron compiles its dataset helpers with the python3 on
# PATH: the venv's comes first.
megatron-lm-smoke: $(STAMP)
	@test -f "$(MEGATRON_LM_PATH)/pretrain_gpt.py" || \
		(echo "set MEGATRON_LM_PATH=/path/to/Megatron-LM (a checkout of tag core_v0.16.1)"; exit 2)
	$(PY) -m pip install -q -e '.[test,megatron-lm]'
	PATH="$(abspath $(VENV))/bin:$$PATH" MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" \
		$(PY) -m pytest -q -m '' tests/integration/test_megatron_lm_integration.py tests/features/*/test_*_megatron_lm.py

# The Megatron-LM smoke per tag (a `git archive` of each tag from MEGATRON_LM_GIT, a Megatron-LM
# clone), each in the venv of its megatron-core: the primary's .venv for core_v0.16.1, .venv-mc<v>
# for the others. core_v0.17.1 is the newest whose training loop imports on Python 3.11; 0.18+
# import typing.override (Python 3.12) in megatron.training (docs/versions.md).
MEGATRON_LM_TAGS ?= core_v0.16.1 core_v0.17.1
megatron-lm-smoke-versions: $(STAMP) $(foreach t,$(filter-out core_v$(PRIMARY_VERSION),$(MEGATRON_LM_TAGS)),.venv-mc$(t:core_v%=%)/.installed)
	@test -d "$(MEGATRON_LM_GIT)" || (echo "set MEGATRON_LM_GIT=/path/to/a Megatron-LM clone (with its core_v* tags)"; exit 2)
	@set -e; for tag in $(MEGATRON_LM_TAGS); do \
		version=$${tag#core_v}; dir=build/megatron-lm/$$tag; \
		if [ "$$version" = "$(PRIMARY_VERSION)" ]; then venv=$(VENV); else venv=.venv-mc$$version; fi; \
		test -f $$dir/pretrain_gpt.py || (mkdir -p $$dir && git --git-dir="$(MEGATRON_LM_GIT)" archive $$tag | tar -x -C $$dir); \
		$$venv/bin/python -m pip install -q six regex pyyaml pydantic; \
		echo "== Megatron-LM $$tag (megatron-core $$version, $$venv)"; \
		PATH="$(CURDIR)/$$venv/bin:$$PATH" MEGATRON_LM_PATH="$(CURDIR)/$$dir" $$venv/bin/python -m pytest -q -m '' \
			tests/integration/test_megatron_lm_integration.py tests/features/*/test_*_megatron_lm.py; \
	done

# The Megatron-LM flag sweep: pretrain_gpt.py with the import line, 3 iterations, for each flag of the checkout's
# arguments.py a CPU run can exercise (read from Megatron-LM's parser), in batches that are bisected when they do
# not train as the run without them did; the record goes to results/megatron-lm-flags.json, its table to
# docs/megatron-lm.md (make docs). Under 10 minutes on a 2-core CPU (MEGATRON_LM_FLAGS_JOBS runs at a time,
# default 2). Without MEGATRON_LM_PATH its tests are skipped with the reason (as in CI without a checkout).
test-megatron-lm-flags: $(STAMP)
	@if [ -f "$(MEGATRON_LM_PATH)/pretrain_gpt.py" ]; then $(PY) -m pip install -q -e '.[test,megatron-lm]'; fi
	PATH="$(abspath $(VENV))/bin:$$PATH" MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" \
		$(PY) -m pytest -q -rs -m '' tests/megatron_lm_flags

# Megatron-LM's own tests/unit_tests on this CPU host with the import line, at LEVEL (0, 1, 2):
# `pytest -p mindspeed_like.testing.megatron_unit_tests` (docs/megatron-tests.md), one session per directory
# (mindspeed_like/testing/megatron_unit/run.py), merged into results/megatron-unit-$(LEVEL).json
# (MEGATRON_UNIT_RECORD=path for another). Needs a Megatron-LM checkout of the installed megatron-core's tag
# (core_v0.16.1); installs the tests' own dependencies; tests written for N ranks run under N gloo ranks
# (MEGATRON_UNIT_RANKS, default 2,4; add 8 to opt in). DIRS: directories (or files) under tests/unit_tests;
# `optimizer` is test_optimizer*.py plus optimizer/. `test-megatron-unit-ci`: the CI-sized part (1 and 2 ranks).
LEVEL ?= 0
DIRS ?=
MEGATRON_UNIT_RANKS ?= 2,4
MEGATRON_UNIT_RECORD ?= results/megatron-unit-$(LEVEL).json
MEGATRON_UNIT_DEPS := click requests pytest-mock mock six regex pyyaml pydantic absl-py
# megatron's Muon / layer-wise optimizer tests assert emerging_optimizers, which megatron pins from GitHub
# (pyproject [tool.uv.sources]: v0.1.0; PyPI's 0.3.0 needs Python 3.12 and renamed use_nesterov). Where GitHub
# cannot be reached, EMERGING_OPTIMIZERS_SRC=/path/to/a/checkout/of/v0.1.0; without either, those tests read
# missing-package and the run goes on (said once).
EMERGING_OPTIMIZERS_SRC ?= git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.1.0
define install_megatron_unit_deps
	$(PY) -m pip install -q $(MEGATRON_UNIT_DEPS)
	@$(PY) -c "import emerging_optimizers" 2>/dev/null || $(PY) -m pip install -q --no-deps "$(EMERGING_OPTIMIZERS_SRC)" \
		|| echo "megatron-unit: emerging_optimizers not installed from $(EMERGING_OPTIMIZERS_SRC): megatron's Muon tests will read missing-package (set EMERGING_OPTIMIZERS_SRC to a checkout of its v0.1.0)"
endef
test-megatron-unit: $(STAMP)
	@test -f "$(MEGATRON_LM_PATH)/tests/unit_tests/conftest.py" || \
		(echo "set MEGATRON_LM_PATH=/path/to/Megatron-LM (a checkout of tag core_v$(PRIMARY_VERSION))"; exit 2)
	$(install_megatron_unit_deps)
	MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" $(PY) -m mindspeed_like.testing.megatron_unit.run --level $(LEVEL) \
		--ranks $(MEGATRON_UNIT_RANKS) --record $(MEGATRON_UNIT_RECORD) $(if $(DIRS),--dirs $(DIRS))

# The tests a level's record set aside for more ranks than its run allowed (written for 8: megatron's CI
# size), straight under 8 gloo ranks in resumable chunks, merged over the record (run.py --rank-skips-of).
# PASSED_IN=results/megatron-unit-0.json: only those level 0 saw pass (at levels 1-2: what can regress).
PASSED_IN ?=
test-megatron-unit-8-ranks: $(STAMP)
	@test -f "$(MEGATRON_LM_PATH)/tests/unit_tests/conftest.py" || \
		(echo "set MEGATRON_LM_PATH=/path/to/Megatron-LM (a checkout of tag core_v$(PRIMARY_VERSION))"; exit 2)
	$(install_megatron_unit_deps)
	MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" $(PY) -m mindspeed_like.testing.megatron_unit.run --level $(LEVEL) \
		--ranks 2,4,8 --rank-skips-of $(MEGATRON_UNIT_RECORD) --record $(MEGATRON_UNIT_RECORD) --resume \
		--pieces-dir build/megatron-unit/ws8-l$(LEVEL) $(if $(PASSED_IN),--passed-in $(PASSED_IN)) \
		$(if $(DIRS),--dirs $(DIRS))

# The CI-sized part: the fastest directories at world size 1 and 2 (under 10 minutes on 2 cores); without
# MEGATRON_LM_PATH it says it skipped and succeeds (CI has no checkout).
CI_DIRS ?= fusions tensor_parallel models/test_gpt_model.py
test-megatron-unit-ci: $(STAMP)
	@if [ ! -f "$(MEGATRON_LM_PATH)/tests/unit_tests/conftest.py" ]; then \
		echo "test-megatron-unit-ci: SKIPPED: MEGATRON_LM_PATH is not set to a Megatron-LM checkout (tag core_v$(PRIMARY_VERSION)), so Megatron-LM's unit tests did not run"; \
	else \
		$(PY) -m pip install -q $(MEGATRON_UNIT_DEPS) && \
		MEGATRON_LM_PATH="$(MEGATRON_LM_PATH)" $(PY) -m mindspeed_like.testing.megatron_unit.run --level $(LEVEL) \
			--ranks 2 --record build/megatron-unit-ci-$(LEVEL).json --dirs $(CI_DIRS); \
	fi

# Megatron-Bridge (NVIDIA's HF <-> Megatron converter) as a client, without TransformerEngine: its own
# `import transformer_engine.pytorch` gets the te-client-module; tiny random Qwen3 / Qwen3-MoE convert,
# match HF's logits, train and export bitwise (tests/te_backend/test_megatron_bridge.py). 0.3.1 is the
# last release for Python 3.11 and megatron-core 0.15-0.16; --no-deps: it declares TE, mamba-ssm and
# more that it does not import for these models. It does need triton (megatron.bridge imports megatron.core's
# inference/contexts/attention_context/triton/tensor_ops.py, which imports it; on a fresh clone the lane failed
# with 9 ModuleNotFoundErrors; a venv that once had the megatron-lm extra hid the missing step).
MEGATRON_BRIDGE_VERSION ?= 0.3.1
megatron-bridge-smoke: $(STAMP)
	$(PY) -m pip install -q --no-deps megatron-bridge==$(MEGATRON_BRIDGE_VERSION)
	$(PY) -m pip install -q "transformers<5" omegaconf "hydra-core<=1.3.2,>1.3" accelerate rich six regex pyyaml tqdm triton
	$(PY) -m pytest -q -s tests/te_backend/test_megatron_bridge.py

# mbridge (verl's default Megatron <-> HF bridge) as a client on a CPU: tiny random Qwen3 / Qwen3-MoE through
# AutoBridge.get_model with the import line and --transfer-to-host, logits within bf16 rounding of HF's, three
# steps lower the loss (tests/te_backend/test_mbridge.py). mbridge lists no requirements in its metadata; it
# imports transformers (<5: the API mbridge 0.15.1 was written for) and safetensors.
MBRIDGE_VERSION ?= 0.15.1
mbridge-smoke: $(STAMP)
	$(PY) -m pip install -q --no-deps mbridge==$(MBRIDGE_VERSION)
	$(PY) -m pip install -q "transformers<5" safetensors
	$(PY) -m pytest -q -s tests/te_backend/test_mbridge.py

# ms-swift (ModelScope's trainer) as a client: its unmodified `megatron sft` CLI, with MINDSPEED_LIKE_AUTOLOAD=1 and
# MINDSPEED_LIKE_ARGS="--transfer-to-host --optimization-level 1" (the import line in every torchrun worker; the client's
# own CUDA calls on the host), on a random 2-layer Qwen3 / Qwen3-MoE, tokenizer and data made locally (no hub;
# --check_model false). Full and LoRA, bf16 / fp16 / fp32, 1 and 2 ranks (DP=2, TP=2 with SP, PP=2, EP=2), a resume
# from ms-swift's dist checkpoint, megatron export's HF logits check (mindspeed_like/testing/ms_swift_smoke.py,
# docs/clients.md). Its own venv, transformers pinned to 4.57.6 (ms-swift 4.6.0 accepts >=4.33,<5.20): with the
# transformers 5 pip picks otherwise, mcore-bridge 1.6.5's rope code reads `config.rope_theta`, which transformers 5's
# Qwen3Config no longer has, and the export's logits check stops before comparing.
# MS_SWIFT_SMOKE_ARGS="--cases ci" runs the CI-sized part (2 launches); tests/te_backend/test_ms_swift.py runs it under
# pytest where ms-swift is installed and skips with the reason elsewhere. Record: MS_SWIFT_RECORD.
MS_SWIFT_VERSION ?= 4.6.0
MCORE_BRIDGE_VERSION ?= 1.6.5
MS_SWIFT_TRANSFORMERS ?= 4.57.6
MS_SWIFT_VENV ?= .venv-ms-swift
MS_SWIFT_RECORD ?= results/ms-swift-smoke.json
$(MS_SWIFT_VENV)/.installed: pyproject.toml setup.py
	test -x $(MS_SWIFT_VENV)/bin/python || $(PYTHON) -m venv $(MS_SWIFT_VENV)
	$(MS_SWIFT_VENV)/bin/python -m pip install -q --upgrade pip
	$(MS_SWIFT_VENV)/bin/python -m pip install -q torch==2.13.0
	printf 'torch==2.13.0\nmegatron-core==$(PRIMARY_VERSION)\ntransformers==$(MS_SWIFT_TRANSFORMERS)\n' > $(MS_SWIFT_VENV)/constraints.txt
	$(MS_SWIFT_VENV)/bin/python -m pip install -q -c $(MS_SWIFT_VENV)/constraints.txt megatron-core==$(PRIMARY_VERSION) \
		ms-swift==$(MS_SWIFT_VERSION) mcore-bridge==$(MCORE_BRIDGE_VERSION) triton
	$(MS_SWIFT_VENV)/bin/python -m pip install -q -c $(MS_SWIFT_VENV)/constraints.txt -e '.[test]'
	touch $@

ms-swift-smoke: $(MS_SWIFT_VENV)/.installed
	$(MS_SWIFT_VENV)/bin/python -m mindspeed_like.testing.ms_swift_smoke --root build/ms-swift-smoke \
		--record $(MS_SWIFT_RECORD) $(MS_SWIFT_SMOKE_ARGS)

clean:
	rm -rf $(VENV) .venv-mc* .venv-ms-swift build *.egg-info .pytest_cache
