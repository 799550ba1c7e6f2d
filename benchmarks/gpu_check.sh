#!/usr/bin/env bash
# The GPU check, one budgeted call:
#
#   bash benchmarks/gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]
#
# Every section in ONE Python process (imports and CUDA start-up once), each in its time slice from the
# table in benchmarks/gpu/check.py (default budget 300 s); writes OUT_DIR/gpu_check.json and
# OUT_DIR/gpu_check.md; exit 0 when every section ran. --dry-run: the same code on the CPU with
# SimulatedMemory and tiny sizes (no GPU needed). It runs the checkout itself, with no installs (the GPU
# machine has torch/lightning/torchvision and no network): the repository root (the package) and
# benchmarks/ (the benchmarks' import root) go on PYTHONPATH. PYTHON names the interpreter (default python3).
set -euo pipefail
if [ "${1:-}" != all ] || [ -z "${2:-}" ]; then
  echo "usage: gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]" >&2
  exit 2
fi
shift
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$here"):$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m gpu.check "$@"
