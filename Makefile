# Two entry points (see README): `make demo` and `make test`.
# Both create .venv when missing and install everything the project needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvxfer-installed
# The CPU build that lies on this kind of machine; override for another torch.
TORCH_SPEC ?= torch==2.13.0
# UCXX per CUDA major (the package's cu12/cu13 extras): cu13 where the driver reports CUDA 13,
# cu12 elsewhere (it runs without a GPU or driver).
UCXX_SPEC ?= $(shell nvidia-smi 2>/dev/null | grep -q 'CUDA Version: 13' && echo ucxx-cu13 || echo ucxx-cu12)>=0.46

# SGLang integration tests run in their own environment: sglang pinned, without its torch pin
# (tests/sglang_pd/requirements.txt), seeing .venv's packages through a .pth file.
SGL_VENV  ?= .venv-sglang
SGL_PY    := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.kvxfer-sglang-installed

.PHONY: demo test test-long test-sglang bench-sglang install clean bench lint

$(STAMP): pyproject.toml setup.py kvxfer/transport/_rma.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) $$( $(PYTHON) -c 'import torch' 2>/dev/null && echo --system-site-packages )
	@# Keep an existing torch (system site or venv); otherwise take the CPU build.
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q "setuptools>=77" wheel "triton>=3.0" "numpy>=1.24" "msgpack>=1.0" "$(UCXX_SPEC)" \
	    "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2" "transformers==5.23.0" "prometheus-client>=0.17" \
	    "ruff==0.17.6" "mypy==2.4.1"
	@# No build isolation: the native RMA extension compiles against the libucx headers installed above.
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvxfer demo

test: lint
	$(PY) -m pytest -q
	$(MAKE) test-sglang

$(SGL_STAMP): $(STAMP) tests/sglang_pd/requirements.txt
	@test -x $(SGL_PY) || $$($(PY) -c 'import sys; print(sys._base_executable)') -m venv $(SGL_VENV)
	@# .venv's site directories (torch, ucxx, kvxfer, pytest; their .pth files too) come after
	@# .venv-sglang's own
	$(PY) -c 'import sys; print("\n".join("import site; site.addsitedir(%r)" % p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
	    > $$($(SGL_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_kvxfer_venv.pth
	$(SGL_PY) -m pip install -q --no-deps --no-compile -r tests/sglang_pd/requirements.txt
	@touch $@

# kvxfer as SGLang's transfer backend, against the real sglang (docs/integrations.md)
test-sglang: $(SGL_STAMP)
	$(SGL_PY) -m pytest -q -p no:cacheprovider tests/sglang_pd

# the SGLang backend's small-request latency vs the raw engine write (bench/results/sgl-latency-cpu.md)
bench-sglang: $(SGL_STAMP)
	UCX_WARN_UNUSED_ENV_VARS=n $(SGL_PY) bench/sgl_latency.py

# ruff (lint + format) and mypy (pyproject.toml has their settings)
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m kvxfer bench transfer

clean:
	rm -rf $(VENV) $(SGL_VENV) build *.egg-info kvxfer/transport/*.so

# Long reliability scenarios (docs/RELIABILITY.md): not part of `make test`.
test-long: $(STAMP)
	$(PY) -m pytest -q -m long -p no:cacheprovider
