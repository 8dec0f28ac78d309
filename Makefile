# The two commands of the README:
#   make demo   set everything up, then run the main job (2 ranks)
#   make test   set everything up, then run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
OUT ?= out
# A second environment with NumPy 2, as on the GPU machine and in most new
# installs; the main one keeps NumPy 1 for Chainer 7.8.1, so Chainer is not
# in it. make test runs the data-plane tests there too.
VENV2 ?= .venv-numpy2
PY2 := $(VENV2)/bin/python
STAMP2 := $(VENV2)/.installed
NUMPY2_TESTS := tests/test_core_mpi.py tests/test_fusion.py tests/test_native.py \
	tests/test_nan_mpi.py tests/test_riders_mpi.py tests/test_torch.py tests/test_torch_mpi.py \
	tests/test_gpu_fallback.py tests/test_tensorflow_bridge.py tests/test_keras.py \
	tests/test_leftovers_mpi.py tests/test_random_collectives_mpi.py
# What NumPy does not touch, the first part has run: a rank stopped or killed,
# and the TensorFlow steps' second configuration of the core.
NUMPY2_SKIP := \
	tests/test_random_collectives_mpi.py::test_a_rank_stopped_half_way_through_a_random_step \
	tests/test_random_collectives_mpi.py::test_a_rank_killed_half_way_through_random_steps \
	"tests/test_random_collectives_mpi.py::test_random_tensorflow_steps_match_numpy_on_every_rank[3_cache"

# Open MPI refuses to start as root without these.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: demo test install clean bench test-gpu gpu-check gpu-prepare

install: $(STAMP)

$(STAMP): setup.py pyproject.toml proto/coordinator.proto
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel "setuptools<70"
	$(PIP) install --quiet "numpy<2"
	# Chainer 7.8.1 builds only with setuptools<70 and without build isolation.
	$(PIP) install --quiet --no-build-isolation chainer==7.8.1
	# numpy<2 on every line: Chainer 7.8.1 imports only with NumPy 1.
	$(PIP) install --quiet torch==2.13.0 tensorflow-cpu==2.21.0 "numpy<2"
	$(PIP) install --quiet -e ".[all]" "numpy<2"
	touch $(STAMP)

# The NumPy-2 environment in two steps: its packages, which make test
# installs beside the first environment's (pip spends most of its time
# unpacking wheels, on one core); then this checkout, in place, once the
# first environment is done: the in-place install builds the native kernels
# and the wire code into the tree, which two installs at once would both write.
DEPS2 := $(VENV2)/.packages
# ml_dtypes 0.7.0 (what pip picks beside NumPy 2 and TensorFlow 2.21) takes
# 1.1 s of CPU to import under NumPy 2.4: it adds hundreds of ufunc loops, and
# NumPy compares each with every one before it. 0.6.0 takes 8 ms. The core
# imported it (bfloat16), so every rank of that part paid it: with 0.7.0 the
# NumPy-2 part took 5 min 57 s to 6 min 26 s in a fresh clone (4 runs),
# against 4 min 22 s with 0.6.0 in the same clone. The core now imports it
# only when bfloat16 is first needed (221bbc9); TensorFlow still imports it.
ML_DTYPES2 := "ml_dtypes>=0.5.1,<0.7"
$(DEPS2): setup.py pyproject.toml proto/coordinator.proto
	$(PYTHON) -m venv $(VENV2)
	$(VENV2)/bin/pip install --quiet --upgrade pip wheel "setuptools<70"
	$(VENV2)/bin/pip install --quiet "numpy>=2" $(ML_DTYPES2) torch==2.13.0 tensorflow-cpu==2.21.0
	touch $@

$(STAMP2): $(DEPS2) | $(STAMP)
	$(VENV2)/bin/pip install --quiet -e ".[torch,tensorflow,test]" "numpy>=2" $(ML_DTYPES2)
	touch $(STAMP2)

# The native kernels, built again in place when one of their sources changes
# after the environment was made (pip's editable install built them first).
NATIVE := build/.native
$(NATIVE): $(wildcard native/*.c) | $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	mkdir -p build && touch $@

DEMO ?= examples/torch/train_digits.py

demo: $(STAMP) $(NATIVE)
	mkdir -p $(OUT)
	$(VENV)/bin/coordrun -np 2 --timeline-filename $(OUT)/timeline.json $(PY) $(DEMO)
	$(PY) -m coordinator.timeline report $(OUT)/timeline.json --plot $(OUT)/stalls.png \
		| tee $(OUT)/stall_report.txt
	@echo "timeline: $(OUT)/timeline.json (open in https://ui.perfetto.dev)"
	@echo "stall report: $(OUT)/stall_report.txt, plot: $(OUT)/stalls.png"

# Two pytest workers (pytest-xdist), each taking whole files: most of the
# suite's time is ranks waiting (for a stall limit, a stopped rank, a
# peer's start), not computing. On this project's 2-core machines the two
# parts went from 23 min 15 s and 4 min 42 s to 13 min 56 s and 3 min 49 s
# (2026-11-30). TEST_WORKERS=0 runs them one at a time in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The two environments' packages install side by side (2 jobs), then the
# rest one step at a time.
test:
	$(MAKE) -j2 $(STAMP) $(DEPS2)
	$(MAKE) $(STAMP2) $(NATIVE)
	$(PY) -m pytest -q $(XDIST) tests
	$(PY2) -m pytest -q $(XDIST) -p no:cacheprovider $(NUMPY2_TESTS) \
		$(addprefix --deselect ,$(NUMPY2_SKIP))

bench: $(STAMP) $(NATIVE)
	$(PY) -m coordinator.bench

# The GPU tests (tests/gpu) at np=2, on the GPU machine: there, from a copy of
# this checkout carrying .device/ (bash ../shared/gpu/prepare.sh fills it here)
# and coordinator/_wire. Elsewhere they skip, saying why.
test-gpu:
	bash .device/device_env.sh bash -c '$$MPIRUN2 $$PY -m pytest -q -rs -p no:cacheprovider tests/gpu'

# Readies .device/ here for the GPU machine (../shared/gpu/prepare.sh), plus
# pytest's wheels, which its image lacks and that script does not fetch.
gpu-prepare: $(STAMP)
	bash ../shared/gpu/prepare.sh
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		-d .device/whl pytest pluggy iniconfig packaging

# Everything issue 13 measures on the GPU machine in one run of at most 8.5
# minutes: the GPU tests, bench --gpu, and the ResNet-18/50 steps against DDP
# (tests/gpu/device_checks.sh; PARTS="bench r50" runs some of them).
gpu-check:
	bash tests/gpu/device_checks.sh $(PARTS)

clean:
	rm -rf $(VENV) $(VENV2) build *.egg-info coordinator/_wire $(OUT)
