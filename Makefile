# h3gate: two commands on a fresh machine.
#   make demo          install into .venv and run the one-block gate on the embedded default (tiny, CPU when no GPU)
#   make test          install the test extra into .venv and run lint + the test suite but the tests marked slow
#                      (and those marked sglang, which make test-sglang runs in a pytest of their own)
#   make test-slow     the tests marked slow (the sm_90 compiles, multi-rank TP8 / TP4xCP2 and the whole model under ws2, the fault
#                      matrix at the small and medium layouts, run arms' four-arm acceptance); CI runs both
# and, for CI and the GPU host:
#   make test-newest   the newest Triton (3.9) in .venv-newest: the default demo and the kernel tests
#   make wheel-smoke   build the wheel, install it without the test extra into a fresh venv, run the CLI elsewhere
#   make wheelhouse    ./.whl/: h3gate's wheel and the wheels an offline GPU host lacks
#                      (docs/guides/offline-gpu-host.md)
#   make install-sglang  SGLang 0.5.23's MiniMax-H3 DiT (the sglang candidate) into $(VENV); CI runs its tests
#   make report        evidence/h200-report/: the committed H200 evidence as one HTML page (h3gate report)
#   make docs          docs/cli.md (from the CLI's command tree) and evidence/h200/PROVENANCE.md (from its records)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.h3gate-installed
TSTAMP  := $(VENV)/.h3gate-test-installed
NVENV   ?= .venv-newest
NBIN    := $(NVENV)/bin
NSTAMP  := $(NVENV)/.h3gate-test-installed
SSTAMP  := $(VENV)/.h3gate-sglang-installed
SGLANG_REQS ?= tools/sglang-requirements.txt
PYTEST_ARGS ?= -n 2

# Torch on a machine without an NVIDIA driver (tools/install_torch.sh): the CPU build of torch $(TORCH_VERSION) from
# torch's CPU index with triton $(TRITON) (the GPU host's), tried alone and failing within seconds when the index
# does not answer; otherwise the pair PyPI resolves, torch $(TORCH_VERSION) with triton $(TRITON_PYPI) (PyPI's
# torch 2.13.0 is the CUDA build, pinned to triton 3.7.1; it runs on the CPU). With a driver, pip's choice.
# test-newest: triton $(TRITON_NEWEST) beside the CPU torch (the +cpu wheel pins no triton; PyPI's CUDA torch 2.13.0
# would refuse it, so that target needs the CPU index or a local CPU wheel of torch, as CI has).
export TORCH_VERSION ?= 2.13.0
export TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
export TRITON ?= 3.6.0
export TRITON_PYPI ?= 3.7.1
TRITON_NEWEST ?= 3.9.0
NO_GPU  := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo 1)

# make wheelhouse: the target host's Python and platform tags, WITH_DIFFUSERS=1 for the parity oracle, WITH_SGLANG=1
# for SGLang's MiniMax-H3 DiT (tools/sglang-requirements.txt), SLIM_SGLANG=1 to fit the device tool's 64 MiB (the
# host's copies of sglang's pins, sglang's wheel without its Rust server, tests and benchmarks, sgl_kernel at sm90).
WHEEL_PY        ?= 3.12
WHEEL_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
WITH_DIFFUSERS  ?=
WITH_SGLANG     ?=
SLIM_SGLANG     ?=
HOST_HAS        ?= tools/gpu-host-packages.txt

.PHONY: install install-test install-sglang test-sglang demo test test-slow lint format test-newest wheel-smoke wheelhouse report docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@if [ -n "$(NO_GPU)" ]; then tools/install_torch.sh $(BIN)/python $(TRITON) $(TRITON_PYPI); fi
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(TSTAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

install: $(STAMP)
install-test: $(TSTAMP)

# SGLang's MiniMax-H3 DiT (h3gate/adapters/sglang): sglang and exactly the packages its import chain needs, pinned in
# $(SGLANG_REQS) and installed with --no-deps (sglang's metadata pins torch 2.14.1 and CUDA packages the DiT does not
# use on the CPU; pip cannot express --no-deps in an extra); then the torchvision paired with the installed torch,
# kept only if it imports (tools/install_torchvision.sh); then the adapter's own check (version, DiT import).
$(SSTAMP): $(SGLANG_REQS) $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -r $(SGLANG_REQS)
	tools/install_torchvision.sh $(BIN)/python
	$(BIN)/python -c "from h3gate.adapters.sglang.runtime import require_sglang as r; print('install-sglang: sglang', r('make install-sglang'))"
	@touch $@

install-sglang: $(SSTAMP)

# The sglang tests (tests/sglang, marker sglang), failing instead of skipping when sglang is missing.
test-sglang: $(TSTAMP) $(SSTAMP)
	H3GATE_REQUIRE_SGLANG=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m sglang tests/sglang

demo: $(STAMP)
	$(BIN)/h3gate run ws1-block

lint: $(TSTAMP)
	$(BIN)/ruff check h3gate kernels tests tools
	$(BIN)/ruff format --check h3gate kernels tests tools

format: $(TSTAMP)
	$(BIN)/ruff format h3gate kernels tests tools
	$(BIN)/ruff check --fix h3gate kernels tests tools

test: lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "not slow and not sglang"

test-slow: $(TSTAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS) -m slow

$(NSTAMP): pyproject.toml
	$(PY) -m venv $(NVENV)
	$(NBIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(NO_GPU)" ]; then tools/install_torch.sh $(NBIN)/python $(TRITON_NEWEST) $(TRITON_NEWEST); fi
	$(NBIN)/python -m pip install -q -e ".[test]" triton==$(TRITON_NEWEST)
	@touch $@

test-newest: $(NSTAMP)
	$(NBIN)/python -c "import triton; v = triton.__version__; assert v == '$(TRITON_NEWEST)', v; print('triton', v)"
	$(NBIN)/h3gate run ws1-block --out evidence/local/ws1-block-newest --force
	TRITON_INTERPRET=1 $(NBIN)/python -m pytest -q $(PYTEST_ARGS) tests/triton_kernels

wheel-smoke:
	PY=$(PY) tools/wheel_smoke.sh

wheelhouse:
	$(PY) tools/wheelhouse.py --python-version $(WHEEL_PY) $(foreach p,$(WHEEL_PLATFORMS),--platform $(p)) \
	  --host-has "$(HOST_HAS)" $(if $(WITH_DIFFUSERS),--with-diffusers) $(if $(WITH_SGLANG),--with-sglang) \
	  $(if $(SLIM_SGLANG),--sglang-host-first --slim-sglang --sgl-kernel-sm90)

report: $(TSTAMP)
	$(BIN)/h3gate report evidence/h200 --out evidence/h200-report

# The generated pages (tests/test_docs.py fails when any is stale). Each PROVENANCE.md is sealed with its folder:
# after it changes, reseal (h3gate seal evidence/h200, evidence/h100).
docs: $(STAMP)
	$(BIN)/python tools/gen_cli_reference.py
	$(BIN)/python tools/gen_provenance.py evidence/h200
	$(BIN)/python tools/gen_provenance.py evidence/h100

clean:
	rm -rf $(VENV) $(NVENV) evidence/local .pytest_cache .ruff_cache .hypothesis build dist
