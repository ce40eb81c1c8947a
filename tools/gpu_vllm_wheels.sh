#!/usr/bin/env bash
# Wheels vLLM 0.33's OpenAI server imports that ../shared/gpu-vllm does not carry (its engine needs none of them).
# Here (pip works):   bash tools/gpu_vllm_wheels.sh            -> .whl/ (git-ignored: echo /.whl/ >> .git/info/exclude)
# On the GPU machine: carry [".gpu-vllm", ".whl"], then
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && source .gpu-vllm/setup.sh
set -euo pipefail
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
  orjson==3.13.0 uvicorn==0.54.0 h11==0.16.0 uvloop==0.23.0 httptools==0.9.0 prometheus_client==0.26.0 \
  prometheus-fastapi-instrumentator==8.1.0 watchfiles==1.3.0 anyio==4.16.0 \
  model_hosting_container_standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
