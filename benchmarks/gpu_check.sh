#!/usr/bin/env bash
# GPU checks.
#
#   bash benchmarks/gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]
#       Every section in ONE Python process (imports and CUDA start-up once), each in its time slice
#       from the table in benchmarks/gpu/check.py (default budget 300 s); writes OUT_DIR/gpu_check.json
#       and OUT_DIR/gpu_check.md; exit 0 when every section ran. --dry-run: the same code on the CPU
#       with SimulatedMemory and tiny sizes (no GPU needed). This is the call to make on a GPU machine.
#
#   bash benchmarks/gpu_check.sh SECTION [OUT_DIR]     (older per-section scripts, one at a time)
#
# Sections: smoke (pytest -m cuda + an import/CPU subset under the machine's own torch), and one
# script per feature under benchmarks/gpu/SECTION.py (memory, oom, batchsize, precision, data, ...).
# Results are written as JSON under OUT_DIR (default: $OUT, else ./gpu_check_out).
# Runs against the checkout itself (PYTHONPATH=repo root), with no installs: the GPU machine has
# torch/lightning/torchvision preinstalled and no network.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
section=${1:?usage: gpu_check.sh SECTION [OUT_DIR]  (sections: smoke $(cd "$here/gpu" && ls *.py 2>/dev/null | sed 's/\.py$//' | tr '\n' ' '))}
out=${2:-${OUT:-$repo/gpu_check_out}}
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [ "$section" = all ]; then
  shift
  out=${1:?usage: gpu_check.sh all OUT_DIR [--budget SECONDS] [--only A,B] [--dry-run]}
  shift
  exec "$py" "$here/gpu/check.py" "$out" "$@"
fi

# A skipped GPU suite must not pass: fail loudly when there is no CUDA device.
"$py" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device visible (torch.cuda.is_available() is False)")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, torch {torch.__version__}")
PY

case "$section" in
  smoke)
    set +e
    "$py" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$out/smoke_cuda.xml" "$repo/tests"
    cuda_rc=$?
    "$py" -m pytest -q -m "not cuda and not slow" -p no:cacheprovider -x --junitxml="$out/smoke_cpu.xml" \
      "$repo/tests/test_batching.py" "$repo/tests/memory"
    cpu_rc=$?
    set -e
    "$py" - "$out" "$cuda_rc" "$cpu_rc" <<'PY'
import json, sys, torch, lightning
out, cuda_rc, cpu_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import lightning_gpuopt
res = {"section": "smoke", "torch": torch.__version__, "lightning": lightning.__version__,
       "device": torch.cuda.get_device_name(0), "cuda_tests_rc": cuda_rc, "cpu_subset_rc": cpu_rc}
json.dump(res, open(f"{out}/smoke.json", "w"), indent=2)
print(json.dumps(res))
sys.exit(1 if cuda_rc or cpu_rc else 0)
PY
    ;;
  *)
    script="$here/gpu/$section.py"
    [ -f "$script" ] || { echo "gpu_check.sh: unknown section '$section'" >&2; exit 2; }
    timeout 300 "$py" "$script" --out "$out"
    ;;
esac
