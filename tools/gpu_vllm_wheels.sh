#!/usr/bin/env bash
# Builds ../shared/gpu-vllm's folder for the GPU machine with the wheels vLLM's OpenAI server (`vllm serve`, the
# tests of tests/test_vllm_serve.py, `vllm bench serve`) imports and the GPU image lacks, so one carried folder
# serves both the engine and the server (versions that worked with 0.33's server; newer than the image's where it
# has one).
#   here (pip works):  bash tools/gpu_vllm_wheels.sh .gpu-vllm              vLLM 0.33.0
#                      bash tools/gpu_vllm_wheels.sh .gpu-vllm-034 0.34.0   vLLM 0.34.0
# The folder must be git-ignored (echo /.gpu-vllm-034/ >> .git/info/exclude); about 45 MiB, under a call's carry.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 FOLDER [VLLM_VERSION]" >&2; exit 2; }
SERVER_WHEELS="orjson==3.13.0 uvicorn==0.54.0 h11==0.16.0 uvloop==0.23.0 httptools==0.9.0 prometheus_client==0.26.0
  prometheus-fastapi-instrumentator==8.1.0 watchfiles==1.3.0 anyio==4.16.0 model_hosting_container_standards==0.1.16
  jmespath==1.1.0 supervisor==4.3.0"
VLLM_VERSION=${2:-0.33.0} EXTRA_WHEELS="$(echo $SERVER_WHEELS)" bash "$(dirname "$0")/../../shared/gpu-vllm/build.sh" "$1"
