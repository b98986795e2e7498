#!/usr/bin/env bash
# One lent GPU's checks in one command (the device tool's run; $OUT receives the reports):
# the cuda-marked tests, the kernels and ring on CUDA (cuda_check.py), the masks (cuda_masks.py) and
# the dry run against a real CUDA allocation (cuda_dryrun_check.py). Each step is bounded by `timeout`.
#     bash scripts/cuda_session.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/cuda_session}
mkdir -p "$O"
log="$O/session.log"
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$log"
step() {
  echo "== $* ($(date -u +%T))" | tee -a "$log"
  local t0=$SECONDS
  timeout "$@" 2>&1 | tee -a "$log"
  echo "== rc ${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$log"
}
step 150 python3 -m pytest -q -m cuda tests/dist/test_cuda.py -p no:cacheprovider
step 240 python3 scripts/cuda_dryrun_check.py --out "$O/cuda_dryrun.json"
step 100 python3 scripts/cuda_check.py --out "$O/cuda_report.json"
step 80 python3 scripts/cuda_masks.py --out "$O/cuda_masks.json"
