#!/usr/bin/env bash
# NVIDIA's CuTe DSL (nvidia-cutlass-dsl 4.8.1, CUDA 13 libs) and QuACK (vLLM 0.33 pins quack-kernels 0.6.5) for vLLM 0.33's
# own Qwen4Exp class on the GPU machine, which has no network. A device call carries 64 MiB with the tracked tree
# (~8 MiB), so they travel in two git-ignored folders (echo '/.dsla/' >> .git/info/exclude; the same for /.dslb/),
# each carried by a call of its own on one warm machine (it is released ~30 s after a call returns: issue them back
# to back):
#   here:                 bash tools/gpu_cute_dsl.sh fetch          (~4 min: xz on two cores)
#   device, call 1:       carry [".dsla"]  bash tools/gpu_cute_dsl.sh stash
#   device, call 2:       carry [".dslb"]  bash tools/gpu_cute_dsl.sh stash
#   device, later calls:  source tools/gpu_cute_dsl.sh install   (installs into /tmp/dsl-site once, exports PYTHONPATH;
#                         after `source .gpu-vllm/setup.sh`, which unpacks vLLM's Python code into /tmp/site)
# The CUDA 13 libs wheel's files, xz-compressed (92 MB as a wheel, 61 MB so), are split: 48 MiB in .dsla, the rest
# in .dslb. .dslb also holds the other wheels, and
# the FlashAttention 3 library vLLM's QSA attention needs: vLLM 0.33's wheel carries it compiled
# (`_vllm_fa3_C.abi3.so` for Hopper, 8 MB as xz, built for torch 2.14, loads in the GPU image's torch 2.11);
# `install` puts it beside the tool's vllm_flash_attn. `stash` and `install` say which part a machine lacks.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -eo pipefail  # not when sourced: it would leak into the caller
V=4.8.1
S=/tmp/dsl-stash
PARTS=("$S/cu13.tar.xz.part.aa:.dsla" "$S/cu13.tar.xz.part.ab:.dslb" "$S/_vllm_fa3_C.abi3.so.xz:.dslb" "$S/quack_kernels-0.6.5-py3-none-any.whl:.dslb")
missing() { for p in "${PARTS[@]}"; do [ -f "${p%%:*}" ] || echo "${p##*:}"; done | sort -u | xargs; }
case "${1:-}" in
fetch)
  rm -rf .dsla .dslb .fa3 /tmp/dsl-fetch && mkdir -p .dsla .dslb /tmp/dsl-fetch/cu13
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/dsl-fetch \
    nvidia-cutlass-dsl==$V nvidia-cutlass-dsl-libs-base==$V nvidia-cutlass-dsl-libs-core==$V \
    nvidia-cutlass-dsl-libs-cu13==$V cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
    quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 einops==0.8.2 vllm==0.33.0
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/dsl-fetch/cu13')" \
    /tmp/dsl-fetch/nvidia_cutlass_dsl_libs_cu13-*.whl  # a wheel installs by unpacking into the target
  tar -C /tmp/dsl-fetch/cu13 -c . | xz -9 -T0 | split -b 48m - /tmp/dsl-fetch/cu13.tar.xz.part.
  mv /tmp/dsl-fetch/cu13.tar.xz.part.aa .dsla/ && mv /tmp/dsl-fetch/cu13.tar.xz.part.ab .dslb/
  python3 -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'))" \
    /tmp/dsl-fetch/vllm-0.33.0-*.whl | xz -9 -T0 > .dslb/_vllm_fa3_C.abi3.so.xz
  rm /tmp/dsl-fetch/nvidia_cutlass_dsl_libs_cu13-*.whl /tmp/dsl-fetch/vllm-0.33.0-*.whl && mv /tmp/dsl-fetch/*.whl .dslb/
  du -sh .dsla .dslb ;;
stash)
  mkdir -p $S && cp .dsla/* .dslb/* $S/ 2>/dev/null || true
  m=$(missing); echo "stashed on this machine: $(ls $S | wc -l) files, $([ -n "$m" ] && echo "still to carry: $m" || echo complete)" ;;
install)
  m=$(missing)
  if [ -n "$m" ]; then
    echo "the CuTe DSL is not stashed on this machine whole (a fresh one?): carry $m with 'stash' first" >&2
  else
    if [ ! -f /tmp/dsl-site/.complete ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dsl-site \
        $S/*.whl 2>&1 | grep -v "WARNING: Target directory" || true
      cat $S/cu13.tar.xz.part.* | xz -dc | tar -x -C /tmp/dsl-site && touch /tmp/dsl-site/.complete
    fi
    xz -dc $S/_vllm_fa3_C.abi3.so.xz > /tmp/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so  # /tmp/site: each call's own
    export PYTHONPATH=/tmp/dsl-site/nvidia_cutlass_dsl/dsl_packages:/tmp/dsl-site${PYTHONPATH:+:$PYTHONPATH}
    DSL_READY=1
  fi ;;
*) echo "usage: $0 fetch|stash|install" >&2; exit 2 ;;
esac
