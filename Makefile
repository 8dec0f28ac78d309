# The two commands of the README:
#   make demo   set everything up, then run the main job (2 ranks)
#   make test   set everything up, then run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
OUT ?= out

# Open MPI refuses to start as root without these.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: demo test install clean bench test-gpu gpu-check

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

DEMO ?= examples/torch/train_digits.py

demo: $(STAMP)
	mkdir -p $(OUT)
	$(VENV)/bin/coordrun -np 2 --timeline-filename $(OUT)/timeline.json $(PY) $(DEMO)
	$(PY) -m coordinator.timeline report $(OUT)/timeline.json --plot $(OUT)/stalls.png \
		| tee $(OUT)/stall_report.txt
	@echo "timeline: $(OUT)/timeline.json (open in https://ui.perfetto.dev)"
	@echo "stall report: $(OUT)/stall_report.txt, plot: $(OUT)/stalls.png"

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m coordinator.bench

# The GPU tests (tests/gpu) at np=2, on the GPU machine: there, from a copy of
# this checkout carrying .device/ (bash ../shared/gpu/prepare.sh fills it here)
# and coordinator/_wire. Elsewhere they skip, saying why.
test-gpu:
	bash .device/device_env.sh bash -c '$$MPIRUN2 $$PY -m pytest -q -rs -p no:cacheprovider tests/gpu'

# Everything issue 13 measures on the GPU machine in one run of about 8
# minutes: the GPU tests, bench --gpu, and the ResNet-18/50 steps against DDP
# (tests/gpu/device_checks.sh; PARTS="bench r50" runs some of them).
gpu-check:
	bash tests/gpu/device_checks.sh $(PARTS)

clean:
	rm -rf $(VENV) build *.egg-info coordinator/_wire $(OUT)
