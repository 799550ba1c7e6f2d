#!/usr/bin/env bash
# The GPU check, one budgeted call: bash benchmarks/gpu_check.sh all OUT_DIR [--budget S] [--only A,B] [--dry-run]
# Every section of benchmarks/gpu/check.py in one Python process (see its docstring and docs/benchmarks.md). It
# runs the checkout itself, no installs: the repository root (the package) and benchmarks/ (the benchmarks'
# import root) go on PYTHONPATH. PYTHON names the interpreter (default python3).
set -euo pipefail
if [ "${1:-}" != all ] || [ -z "${2:-}" ]; then
  echo "usage: gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]" >&2
  exit 2
fi
shift
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$here"):$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m gpu.check "$@"
