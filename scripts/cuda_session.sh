#!/usr/bin/env bash
# One lent GPU's session in one command (the device tool's run; about 7.6 minutes at most on one H200):
# every step is bounded by `timeout` and writes its JSON under $OUT (a failing case records its error and
# the rest run; a step cut by its timeout keeps the cases it finished). Issue 42 reads the results.
#     bash scripts/cuda_session.sh          # on the GPU machine ($OUT: where the reports go)
#     bash scripts/cuda_session.sh --dry    # on a CPU: every step's inputs at tiny sizes, run once (CI)
# Steps: the cuda-marked tests; env; exact (world 1 and the emulated ring P = 2, 4, 8); world1 (against
# SDPA); per_rank (one rank of a world-P plan); masks; hybrids; dryrun (against the allocator);
# calibrate (the device's rates) and `burstattn sim calibrate`. Needs torch's CUDA build only:
# flash-attn, flash-linear-attention and transformers are used where installed, skipped (and named) where not.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/cuda_session}
mkdir -p "$O"
if [ "${1:-}" = "--dry" ]; then
  exec timeout 300 python3 scripts/cuda_session.py --step all --dry --out "$O"
fi
log="$O/session.log"
rcs="$O/steps.tsv"
: > "$rcs"
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$log"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $* ($(date -u +%T), at most $limit s)" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$rcs"
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$log"
}
py() { step "$1" "$2" python3 scripts/cuda_session.py --step "$1" --out "$O"; }
step tests 40 python3 -m pytest -q -m cuda tests/dist/test_cuda.py -p no:cacheprovider
py env 10
py exact 55
py world1 50
py per_rank 55
py masks 95
py hybrids 45
py dryrun 60
py calibrate 20
step sim_calibrate 25 python3 -m burstattn.cli sim calibrate --seconds 0.2 --rounds 1 --out "$O/cluster-spec.json"
python3 - "$rcs" "$O/steps.json" <<'EOF'
import json, sys
rows = [dict(zip(("step", "rc", "seconds", "limit"), line.rstrip("\n").split("\t"))) for line in open(sys.argv[1]) if line.strip()]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
print("steps:", ", ".join(f"{r['step']} rc {r['rc']} ({r['seconds']} s)" for r in rows))
EOF
