#!/usr/bin/env bash
# A lent GPU's work in one call: the environment, the 8B-shape timings, then the engine's tests on CUDA.
#
#   device run: BRAID_COMMIT=<sha> BRAID_DIRTY=0 bash benchmarks/device_run.sh   (the tool sets OUT; results come
#               back from it. The copy of the tree there has no .git: the commit is passed for the results' stamps)
#   here, as a dry run of every step: SHAPE=tiny DEVICE=cpu OUT=/tmp/dev bash benchmarks/device_run.sh
# Each step has its own time limit and the next runs whatever it returned; one log, $OUT/device.log.
# STEPS picks some of: graph_tests profile_decode calibration_cost synthesis_ttft kvcomm batched_forward engine_tests
# (default: all);
# LAYERS cuts the shape's layers for profile_decode (0: all of them); TESTS picks the engine tests.
# tests/test_cli_and_bench.py runs the dry run (the install as pip's --dry-run, one engine test file).
set -u
OUT=${OUT:-/tmp/braid-device}
SHAPE=${SHAPE:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
if [[ $SHAPE == tiny ]]; then  # (the dry run: branches that fit the tiny shape's 4096 positions, one timed run)
  LENGTHS=${LENGTHS:-64 128}; REPEATS=${REPEATS:-1}; GROUPS_=${GROUPS_:-1 4}; KV_GIB=${KV_GIB:-0}
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONSAFEPATH=1  # (the checkout's top-level folders, kernels/ among them, must not shadow packages)
exec > >(tee -a "$OUT/device.log") 2>&1
log() { echo "== $(date +%T) $*"; }
STEPS=${STEPS:-graph_tests profile_decode calibration_cost synthesis_ttft kvcomm batched_forward engine_tests}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  case "$name" in  # (the 8B checkpoint only for the steps that read it)
    checkpoint) [[ " $STEPS " =~ " "(synthesis_ttft|kvcomm|batched_forward|calibration_cost)" " ]] || return 0 ;;
    *) [[ " $STEPS " == *" $name "* ]] || return 0 ;;
  esac
  log "$name"
  timeout "$secs" "$@" 2>&1 | grep -v -E "it/s\]|s/it\]|request/s\]|text/s\]" ; log "$name rc=${PIPESTATUS[0]}"
}
log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
log "install"
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3; log "install rc=${PIPESTATUS[0]}"
step graph_tests 90 env BRAID_TEST_DEVICE="$DEVICE" $PY -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_cuda_graphs.py
step profile_decode 300 $PY benchmarks/profile_decode.py --shape "$SHAPE" --layers "${LAYERS:-0}" --device "$DEVICE" \
  --rows 15 --flex --kv-gib "${KV_GIB:-8}" ${DECODE_ARGS:-} --out "$OUT"
MODEL=/tmp/braid-random-$SHAPE
step checkpoint 240 $PY -c "
import sys, time, torch
from braid.models.checkpoints import make_random_checkpoint
t = time.time()
make_random_checkpoint('$MODEL', 'llama', '$SHAPE', dtype=torch.bfloat16 if '$DEVICE' != 'cpu' else torch.float32,
                       device='$DEVICE')
print(f'$SHAPE random checkpoint in {time.time() - t:.0f} s')"
step calibration_cost 240 $PY benchmarks/calibration_cost.py --model "$MODEL" --shape "$SHAPE" --device "$DEVICE" \
  --dtype bfloat16 ${CAL_ARGS:---steps 6 --warmup 2 --tasks-per-step 4} --out "$OUT"
step synthesis_ttft 240 $PY benchmarks/synthesis_ttft.py --checkpoint "$MODEL" --device "$DEVICE" \
  --repeats "${REPEATS:-5}" ${LENGTHS:+--lengths $LENGTHS} --out "$OUT"
step kvcomm 150 $PY benchmarks/kvcomm_ttft.py --model "$MODEL" --device "$DEVICE" ${KV_ARGS:-} --out "$OUT"
step batched_forward 120 $PY benchmarks/batched_forward.py --model "$MODEL" --device "$DEVICE" \
  --groups ${GROUPS_:-1 4 16 64} --context 1024 --out "$OUT"
rm -rf "$MODEL"
TESTS=${TESTS:-tests/test_rope.py tests/test_engine.py tests/test_scheduler.py tests/test_synthesis.py \
  tests/test_prefix_cache.py tests/test_calibration.py tests/test_prompt_tree.py tests/test_cuda_graphs.py}
step engine_tests "${TEST_SECONDS:-150}" env BRAID_TEST_DEVICE="$DEVICE" $PY -m pytest -q -rf --tb=short \
  -p no:cacheprovider -p no:warnings $TESTS
log done
