#!/usr/bin/env bash
# A training run on a lent GPU in one call: install the checkout, train, and bring the checkpoint back.
#
#   device run: bash train/device_train.sh ARGS...     (ARGS go to python -m braid.train.train; --out is set here)
#   here, as a dry run: INSTALL=0 DEVICE_ARGS="--device cpu" OUT=/tmp/dev bash train/device_train.sh --steps 2 ...
# The tool brings back at most 8 files of at most 16 MiB each, so the checkpoint comes back as a tar split in
# 15 MiB parts, $OUT/checkpoint.tar.NN; here: cat <files_at>/checkpoint.tar.* | tar x -C DIR. One log: $OUT/train.log.
set -u
OUT=${OUT:-/tmp/braid-train}
RUN=${RUN:-/tmp/braid-train-run}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-30}
exec > >(tee -a "$OUT/train.log") 2>&1
echo "== $(date +%T) environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())"
[ "${INSTALL:-1}" = 1 ] && $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
echo "== $(date +%T) train $*"
# shellcheck disable=SC2086  # (DEVICE_ARGS is a list of flags)
$PY -m braid.train.train --out "$RUN" "$@" ${DEVICE_ARGS:-}
rc=$?
echo "== $(date +%T) train rc=$rc"
if [ -f "$RUN/training.json" ]; then
  tar cf - -C "$RUN" . | split -b 15M -d - "$OUT/checkpoint.tar."
  ls -l "$OUT"
fi
exit $rc
