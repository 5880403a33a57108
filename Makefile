# Two entry points for a fresh machine: `make demo` and `make test` (each sets everything up first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build on the CI machines' disk; on a GPU box, an existing torch in the venv is kept.
INSTALL := torch==2.13.0 transformers==5.17.0 -e .[models,test,ruler,serve]

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(INSTALL)
	touch $@

.PHONY: setup demo test gpu-check
setup: $(BIN)/.installed

demo: setup
	$(BIN)/nanovllm generate

test: setup
	$(BIN)/python -m pytest -q

# On a CUDA machine whose Python already has torch, triton and transformers (the H200 image): the kernel
# tests (on CUDA at real sizes and dtypes), every cuda-marked test (SmolLM2 ones need the model fetched
# or in NANOVLLM_CACHE), then the speed benchmarks. Results as JSON in $$OUT (else bench/results).
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -m cuda tests
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q tests/test_kernels.py tests/test_fused_ops.py tests/test_sampler.py -k "cuda or host or fused"
	cd bench && PYTHONPATH=$(CURDIR) $(PYTHON) -u profile_step.py
	cd bench && PYTHONPATH=$(CURDIR) $(PYTHON) -u throughput.py --async-scheduling
	cd bench && PYTHONPATH=$(CURDIR) $(PYTHON) -u latency.py
	cd bench && PYTHONPATH=$(CURDIR) $(PYTHON) -u offload.py --cases 1x32768 4x32768 1x65536 1x98304 --skip-hf
