#!/usr/bin/env bash
# The GPU runs of tests/README.md and docs/PERFORMANCE.md, step by step, on the device machine (vLLM 0.33 through
# ../shared/gpu-vllm; the CuTe DSL and FA3 of gpu_cute_dsl.sh when stashed there). Carry [".gpu-vllm"] (the steps
# file-tier, lookup-tp1, drop and keep-cache alone need nothing carried: the image's torch runs them), then:
#   STEPS...                       what runs, in order, in one call:
#   hc                             benchmarks/bench_hyper_connection.py --sweep    -> $OUT/hyper_connection
#   micro                          ROUNDS (default 3) rounds, in turn, of bench_lookup, bench_prefetch (--repeats 3) and
#                                  bench_hyper_connection --sweep: one file a round for docs/PERFORMANCE.md's medians
#                                  -> $OUT/micro/roundN (FIRST_ROUND: a later call's first N; ~minutes a round: `start`;
#                                  MICRO: which of "lookup prefetch hc", default all three)
#   peer-long                      benchmarks/peer_logprobs.py --long: vLLM's own class and ours on the sharpened tiny
#                                  checkpoint, prompts beyond the QSA budget (the CuTe DSL stashed first; GPU_VLLM=
#                                  .gpu-vllm-034: vLLM 0.34, the long-context test's release)  -> $OUT/peer_logprobs_long
#   write                          the release-geometry checkpoints (KINDS, default "int8 fp8"; ~80 s the first time;
#                                  TABLE_GB, default 13: the TP4 rank's table; 52: the whole table at TP1, KINDS=int8
#                                  and LAYERS=12 for write and serve: 48 layers' other weights take it past the disk's 64 GB;
#                                  LAYERS, default 48)
#   serve                          bench_serve at the release geometry (VARS: variants and flags, MODE: graph mode,
#                                  default full_decode_only; PROMPTS: default uniform)  -> $OUT/serve
#                                  DOWN_SILU: host_int8_down_launch's launch, a sweep label, or best16: the last hc
#                                  sweep's fastest launch at 16 tokens inside the block (kept under /tmp while the
#                                  machine is warm); SERVE_ARGS: more flags (e.g. "--cold-reads --first-round 2");
#                                  SERVE_OUT: a folder under /tmp that later calls add their rounds to (copied to $OUT)
#   load                           benchmarks/serve_load.py at the release geometry: `vllm serve` per variant (VARS, each on
#                                  the checkpoint of its table kind) with configs/serve_load_h200.yaml, driven by vLLM's
#                                  harness (LOAD=bench, the default) or soaked (LOAD=soak, 6 min); LOAD_ARGS: more flags
#                                  (e.g. "--concurrency 8 64"). A call adds its runs to /tmp/serve_load (kept while the
#                                  machine is warm: one variant a call fits the call's time)  -> $OUT/serve_load
#   test                           pytest $TESTS [-k "$K"] (LIM: seconds, default 500; every case runs, no -x: one failure
#                                  must not hide the others' figures; each case's outcome as it ends, the last TAIL lines
#                                  (default 40); result files -> $OUT/results)
#   suite                          tools/gpu_suite.py: the GPU tests not yet recorded for this commit and vLLM release,
#                                  in order, none started after BUDGET s (default 420), all stopped at LIM s (default
#                                  540); one JSON per test under benchmarks/results/gpu_suite/ -> $OUT/gpu_suite.tar
#                                  (the folder, carried in again: untar it here, call again until "0 left"); the log ->
#                                  $OUT/gpu_suite.log; MULTI=1: the multi_gpu tests too; SUITE_ARGS: pytest's arguments
#                                  (test files first: those files only, in that order). Needs the CuTe DSL stashed
#                                  (FlashAttention 3, the tiny engines' default backend); NO_DSL=1: no engine selected
#   start                          the steps of BG (e.g. BG="write serve") in the background, from a copy of the tree at
#                                  /tmp/bg/tree, their $OUT at /tmp/bg/out (their own process session: they run on between
#                                  calls while the machine is held, nothing cut at a call's end, no engine started twice);
#                                  alone in its call. Then waits as `wait` does. For runs longer than a call: bench_serve's
#                                  rounds (SERVE_ARGS="--rounds 3"), a soak (LOAD=soak LOAD_ARGS="--minutes 20")
#   wait                           alone in a call, carrying nothing: waits for the background steps until WAIT s (default
#                                  560) after the call began; then the log -> $OUT/bg.log, their $OUT so far ->
#                                  $OUT/bg_out.tar, the suite's records -> $OUT/gpu_suite.tar (no set-up: the running
#                                  steps' installs stay as they are)
#   suite-start                    `start` of the whole suite (`suite-all`: FIRST, test files run before the rest, then the
#                                  rest; none started after BUDGET s, default 1300). One pytest at a time: engines started
#                                  side by side fail vLLM's free-memory check at start (it asks gpu_memory_utilization of
#                                  the whole card), and their compiles share the 16 cores
#   suite-wait                     `wait`
#   drop                           delete the release checkpoints of DROP (e.g. "int8 fp8": the disk holds ~22 GB more,
#                                  the BF16 one upstream's vllm_host_bf16 / vllm_gpu_bf16 read needs 26 GB)
#   lookup-tp1                     bench_lookup on the release's whole 52 GB TP1 table, one host copy (82 s; the
#                                  GPU-resident reference takes 52 GB)  -> $OUT/lookup_release_tp1; HUGE=1: that copy on
#                                  2 MiB pages -> $OUT/lookup_release_tp1_huge
#   file-tier                      benchmarks/bench_file_tier.py on an 8 GB table of the release's rows: lookups at 100 / 50 / 20 /
#                                  5 % resident, text / Zipf / uniform ids, cold and warm (no vLLM)  -> $OUT/file_tier;
#                                  FT_ARGS replaces "--table-gb 8" (e.g. "--table-gb 13 --shares 1 0.2 0.05": the TP4
#                                  rank's table at budgets that bind)
#   memory                         GPU bytes after load, the default 2 GB host table, per graph mode (MODES, default the
#                                  torch.compile ones, where Inductor could copy a table; VARS default "host_int8 gpu_int8")
#                                  -> $OUT/memory_MODE
#   keep-cache                     Triton's kernel cache (~/.triton/cache) -> $OUT/triton-cache/part.* (xz, 15 MiB parts):
#                                  a first engine start compiles for 2-3 min. Here: mkdir -p .triton-cache && cp
#                                  /work/.device/N/triton-cache/part.* .triton-cache/ (git-ignored: echo /.triton-cache/
#                                  >> .git/info/exclude); carry [".gpu-vllm", ".triton-cache"] and every step restores it first
# e.g. TESTS="tests/test_short_conv.py" VARS="host_int8 vllm_host_fp8 --profile" bash tools/gpu_session.sh test serve
# Checkpoints stay under /tmp/bench_serve while the machine is warm; results come back under $OUT.
# QWEN4_EXP_HCU_COMMIT: the commit the results record (the machine gets the tree without git): pass
#   $(git rev-parse HEAD) from here; `test` also writes $OUT/results/suite_vllm-<release>_<time>.json.
# GPU_VLLM: the engine's folder (default .gpu-vllm, vLLM 0.33; .gpu-vllm-034 from
#   bash tools/gpu_vllm_wheels.sh .gpu-vllm-034 0.34.0 for vLLM 0.34; carry it instead).
CALL_T0=$(date +%s)
BG_DIR=/tmp/bg
wait_bg() {  # until the background steps end or WAIT s after the call began (its set-up counted: the call must
  # return within its limit to bring the files back); what they have written so far comes back either way
  while [ ! -e $BG_DIR/done ] && [ $(( $(date +%s) - CALL_T0 )) -lt "${WAIT:-560}" ]; do sleep 5; done
  [ -e $BG_DIR/done ] && echo "background steps ended" || echo "background steps still running"
  echo "--- $BG_DIR/log"  # without engine logs and pytest's warnings summaries
  grep -av "^INFO\|^WARNING\|^\[\|^(\|^ \|^$\|warnings summary\|^-- Docs" $BG_DIR/log | cut -c1-300 | tail -"${TAIL:-16}"
  cp $BG_DIR/log "$OUT/bg.log"
  [ -n "$(ls -A $BG_DIR/out)" ] && tar -cf "$OUT/bg_out.tar" -C $BG_DIR out  # one file: $OUT returns 8 at most
  grep -qw "suite\|suite-all" $BG_DIR/steps \
    && (cd $BG_DIR/tree && tar -cf "$OUT/gpu_suite.tar" --exclude='*.tmp' benchmarks/results/gpu_suite)
}
case $1 in
  wait|suite-wait) wait_bg; exit 0 ;;
  start|suite-start)  # the background's own call of this script sets itself up in its copy of the tree
    [ "$1" = suite-start ] && BG=suite-all
    [ -n "$BG" ] || { echo "start: BG names no steps" >&2; exit 2; }
    rm -rf $BG_DIR && mkdir -p $BG_DIR/tree $BG_DIR/out && cp -a . $BG_DIR/tree/ && echo "$BG" > $BG_DIR/steps
    (cd $BG_DIR/tree && BG="$BG" setsid nohup bash -c 'OUT='$BG_DIR'/out bash tools/gpu_session.sh $BG; touch '$BG_DIR'/done' \
      > $BG_DIR/log 2>&1 < /dev/null &)
    echo "=== $BG in the background"; wait_bg; exit 0 ;;
esac
if [[ " $* " == *" "@(write|serve|load|test|suite|suite-all|memory|hc|micro|peer-long)" "* ]]; then  # the steps that run vLLM's or the package's installed code
  source "${GPU_VLLM:-.gpu-vllm}/setup.sh"
else  # file-tier, lookup-tp1, drop, keep-cache: the image's torch and the tree alone, nothing to carry
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# Merged once per machine, also into a cache an earlier call (a sweep) has started.
if compgen -G ".triton-cache/part.*" > /dev/null && [ ! -e ~/.triton/.restored ]; then
  mkdir -p ~/.triton && cat .triton-cache/part.* | tar -xJ -C ~/.triton && touch ~/.triton/.restored \
    && echo "Triton cache restored: $(ls ~/.triton/cache | wc -l) kernels"
fi
[ -d /tmp/dsl-stash ] && source tools/gpu_cute_dsl.sh install  # sets DSL_READY, or says which part to carry
if [[ " $* " == *" "@(suite|suite-all)" "* ]] && [ -z "$DSL_READY" ] && [ -z "$NO_DSL" ]; then
  # the tiny-engine tests take vLLM's default attention backend, FlashAttention 3 on Hopper, whose library comes with
  # the stash; without it every engine fails at its first step ("FlashAttention version not detected")
  echo "the suite's engine tests need FlashAttention 3 from the CuTe DSL stash: the stash calls first" \
    "(NO_DSL=1: a SUITE_ARGS selection that starts no engine)" >&2
  exit 3
fi
export TABLE_GB=${TABLE_GB:-13} LAYERS=${LAYERS:-48}
export W=/tmp/bench_serve/release-${TABLE_GB}gb-${LAYERS}layers-budget2048
B="--geometry release --table-gb $TABLE_GB --layers $LAYERS --indexer-budget 2048"
for step in "$@"; do
  t0=$(date +%s); echo "=== $step"
  case $step in
  hc) python3 -m benchmarks.bench_hyper_connection --sweep --out "$OUT/hyper_connection" 2>&1 | grep -v "^[0-9]* {" | tail -25
      cp "$OUT/hyper_connection/bench_hyper_connection.json" /tmp/last_hc_sweep.json
      python3 -c "import json; r = json.load(open(\"$OUT/hyper_connection/bench_hyper_connection.json\"))[\"results\"]; [print(t, {k: round(v, 2) for k, v in x.items() if k.startswith(\"ratio\")}) for t, x in r.items()]" ;;
  peer-long) rm -rf /tmp/peer-long && python3 -m benchmarks.peer_logprobs /tmp/peer-long --long --out "$OUT/peer_logprobs_long" 2>&1 \
               | grep -av "^INFO\|^WARNING\|^\[\|^(" | tail -40 ;;
  micro) for i in $(seq "${FIRST_ROUND:-1}" $(( ${FIRST_ROUND:-1} + ${ROUNDS:-3} - 1 ))); do
           r="$OUT/micro/round$i"; echo "--- round $i"
           m=" ${MICRO:-lookup prefetch hc} "
           [[ $m == *" lookup "* ]] && python3 -m benchmarks.bench_lookup --out "$r" 2>&1 | tail -6
           [[ $m == *" prefetch "* ]] && python3 -m benchmarks.bench_prefetch --repeats 3 --out "$r" 2>&1 | tail -3
           [[ $m == *" hc "* ]] && python3 -m benchmarks.bench_hyper_connection --sweep --out "$r/hyper_connection" 2>&1 \
             | grep -v "^[0-9]* {" | tail -3
           true
         done ;;
  write) python3 - <<'PY' 2>&1 | tail -5
import os, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import bench_serve as b
model = {**b.release_model(float(os.environ["TABLE_GB"])), **b.depth(int(os.environ["LAYERS"])), "indexer_budget": 2048}
print(b.write_checkpoints(Path(os.environ["W"]), model, set(os.environ.get("KINDS", "int8 fp8").split())))
PY
         sync ;;  # the tens of GB just written flush now, not under the first engine's timings
  serve) if [[ " $VARS" == *" vllm_"* ]] && [ -z "$DSL_READY" ]; then  # before minutes of engine start
           echo "vLLM's class needs the CuTe DSL, not stashed on this machine (a fresh one?): the stash calls first" >&2
           exit 3
         fi
         if [ "$DOWN_SILU" = best16 ]; then
           DOWN_SILU=$(python3 -c "import json; print(json.load(open('/tmp/last_hc_sweep.json'))['down_silu_in_block']['16']['best'])") \
             && echo "best16: $DOWN_SILU"
         fi
         python3 -m benchmarks.bench_serve $B --graph-mode "${MODE:-full_decode_only}" --prompts ${PROMPTS:-uniform} \
           ${DOWN_SILU:+--down-silu "$DOWN_SILU"} --variants $VARS $SERVE_ARGS --out "${SERVE_OUT:-$OUT/serve}" 2>&1 \
           | grep -v "^INFO\|^WARNING\|^\[" | cut -c1-600 | tail -30
         [ -n "$SERVE_OUT" ] && cp -r "$SERVE_OUT" "$OUT/serve"
         for f in "$W"/*.log; do echo "--- $f"; grep -i "error\|Traceback" "$f" | tail -5; done ;;
  load) if [[ " $VARS" == *" vllm_"* ]] && [ -z "$DSL_READY" ]; then echo "vLLM's class needs the CuTe DSL: stash it first" >&2; exit 3; fi
        v=(); for name in $VARS; do v+=("$name=$W/bench-${name##*_}"); done  # host_int8 -> bench-int8, vllm_host_fp8 -> bench-fp8
        [ "${LOAD:-bench}" = soak ] && LOAD_ARGS="--minutes 6 --sample-s 20 $LOAD_ARGS"  # what fits a call; LOAD_ARGS overrides
        python3 -m benchmarks.serve_load --mode "${LOAD:-bench}" --variant "${v[@]}" --server-args "--config configs/serve_load_h200.yaml" \
          --out /tmp/serve_load $LOAD_ARGS 2>&1 | grep -av "^INFO\|^WARNING\|^(" | cut -c1-400 | tail -30
        cp -r /tmp/serve_load "$OUT/" ;;
  test) timeout "${LIM:-500}" python3 -m pytest -v -s -rfs -p no:cacheprovider --results-dir "$OUT/results" $TESTS ${K:+-k "$K"} 2>&1 \
          | grep -a "PARITY\|passed\|failed\|PASSED\|FAILED\|ERROR\|Error\|^SKIPPED\|^E " | grep -av "::.* SKIPPED" \
          | cut -c1-400 | tail -"${TAIL:-40}" ;;  # -v: each case's outcome as it ends, so a run LIM cuts says which cases ran
  suite) timeout "${LIM:-540}" python3 tools/gpu_suite.py --budget-s "${BUDGET:-420}" ${MULTI:+--multi-gpu} $SUITE_ARGS 2>&1 \
           | tee "$OUT/gpu_suite.log" | grep -av "^INFO\|^WARNING\|^\[" | cut -c1-400 | tail -"${TAIL:-40}"
         tar -cf "$OUT/gpu_suite.tar" --exclude='*.tmp' benchmarks/results/gpu_suite ;;  # one file: $OUT returns 8 at most
  suite-all) end=$(( $(date +%s) + ${BUDGET:-1300} ))
             [ -n "$FIRST" ] && python3 tools/gpu_suite.py --budget-s "${BUDGET:-1300}" ${MULTI:+--multi-gpu} -- $FIRST
             left=$(( end - $(date +%s) ))
             [ "$left" -gt 0 ] && python3 tools/gpu_suite.py --budget-s "$left" ${MULTI:+--multi-gpu} -- ${SUITE_ARGS:-tests} ;;
  drop) for kind in $DROP; do rm -rf "$W/bench-$kind"; done; df -h /tmp | tail -1 ;;
  lookup-tp1) python3 -m benchmarks.bench_lookup --dim 160 --heads-per-ngram 8 --table-gb 52 --one-host-copy \
                ${HUGE:+--huge-pages} --formats-table-gb 0 --out "$OUT/lookup_release_tp1${HUGE:+_huge}" 2>&1 \
                | grep -v "^ \|^{\|^}" | tail -40 ;;
  file-tier) python3 -m benchmarks.bench_file_tier ${FT_ARGS:---table-gb 8} --dir /tmp/file-tier --out "$OUT/file_tier" 2>&1 | tail -60 ;;
  memory) for m in ${MODES:-full_and_piecewise piecewise full_decode_only_compiled}; do
            python3 -m benchmarks.bench_serve --memory-only --graph-mode "$m" --variants ${VARS:-host_int8 gpu_int8} \
              --out "$OUT/memory_$m" 2>&1 | grep -v "^INFO\|^WARNING\|^\[" | cut -c1-400 | tail -6
          done ;;
  keep-cache) mkdir -p "$OUT/triton-cache" && tar -c -C ~/.triton cache | xz -T0 | split -b 15m - "$OUT/triton-cache/part."  # xz on every core: one took 129 s for 242 MB
              du -sh ~/.triton/cache "$OUT/triton-cache" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  echo "=== $step done in $(( $(date +%s) - t0 )) s"
done
