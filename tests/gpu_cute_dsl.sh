#!/usr/bin/env bash
# NVIDIA's CuTe DSL (nvidia-cutlass-dsl 4.8.1, CUDA 13 libs) and QuACK (vLLM 0.33 pins quack-kernels 0.6.5) for vLLM 0.33's own Qwen4Exp class on the GPU machine,
# which has no network. Its CUDA 13 libs wheel (92 MB) exceeds one device call's 64 MiB carry, so it travels in
# two git-ignored folders (echo '/.dsl*/' >> .git/info/exclude), carried by two calls on a warm machine:
#   here:                 bash tests/gpu_cute_dsl.sh fetch
#   device, call 1:       carry [".dsla"]  bash tests/gpu_cute_dsl.sh stash
#   device, call 2:       carry [".dslb"]  bash tests/gpu_cute_dsl.sh stash
#   device, call 3:       carry [".fa3"]   bash tests/gpu_cute_dsl.sh stash
#   device, later calls:  source tests/gpu_cute_dsl.sh install   (joins, installs into /tmp/dsl-site, exports PYTHONPATH;
#                         after `source .gpu-vllm/setup.sh`, which unpacks vLLM's Python code into /tmp/site)
# The class's QSA attention also needs FlashAttention: vLLM 0.33's wheel carries it compiled (`_vllm_fa3_C.abi3.so`
# for Hopper, 42 MB zipped, built for torch 2.14, loads in the GPU image's torch 2.11): `fetch` takes that one
# file into .fa3 (echo '/.fa3/' >> .git/info/exclude) and `install` puts it beside the tool's vllm_flash_attn.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -eo pipefail  # not when sourced: it would leak into the caller
V=4.8.1
case "${1:-}" in
fetch)
  rm -rf .dsla .dslb /tmp/dsl-fetch && mkdir -p .dsla .dslb /tmp/dsl-fetch
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/dsl-fetch \
    nvidia-cutlass-dsl==$V nvidia-cutlass-dsl-libs-base==$V nvidia-cutlass-dsl-libs-core==$V \
    nvidia-cutlass-dsl-libs-cu13==$V cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
    quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 einops==0.8.2
  big=$(ls /tmp/dsl-fetch/nvidia_cutlass_dsl_libs_cu13-*.whl)
  split -b 46m "$big" .dsla/part. && mv .dsla/part.ab .dslb/ && basename "$big" > .dslb/name
  mv /tmp/dsl-fetch/*.whl .dslb/ 2>/dev/null; rm -f ".dslb/$(basename "$big")"
  rm -rf .fa3 && mkdir -p .fa3
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    -d /tmp/dsl-fetch vllm==0.33.0
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); o = zipfile.ZipFile('.fa3/fa3.zip', 'w', zipfile.ZIP_DEFLATED, compresslevel=9)
o.writestr('_vllm_fa3_C.abi3.so', z.read('vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so')); o.close()" /tmp/dsl-fetch/vllm-0.33.0-*.whl
  du -sh .dsla .dslb .fa3 ;;
stash)
  mkdir -p /tmp/dsl-stash && cp .dsla/* .dslb/* .fa3/* /tmp/dsl-stash/ 2>/dev/null || true; ls -la /tmp/dsl-stash ;;
install)
  cd /tmp/dsl-stash && cat part.aa part.ab > "$(cat name)" && cd - > /dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dsl-site \
    /tmp/dsl-stash/*.whl 2>&1 | grep -v "WARNING: Target directory" || true
  python3 -c "import zipfile; zipfile.ZipFile('/tmp/dsl-stash/fa3.zip').extractall('/tmp/site/vllm/vllm_flash_attn')"
  export PYTHONPATH=/tmp/dsl-site/nvidia_cutlass_dsl/dsl_packages:/tmp/dsl-site${PYTHONPATH:+:$PYTHONPATH} ;;
*) echo "usage: $0 fetch|stash|install" >&2; exit 2 ;;
esac
