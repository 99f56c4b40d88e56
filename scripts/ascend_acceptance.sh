#!/usr/bin/env bash
# Acceptance run for an Ascend node with 8 devices (not run by this repository's CI, which has no NPU).
# Runs every Ascend claim (start-up of each shipped layout, layout agreement on the tiny recipe, BF16
# vs FP32, kill -9 and resume under TP/PP, peak device memory next to --plan) and writes
# OUT/acceptance.json + OUT/acceptance.md with PASS / FAIL / NOT RUN per check (training/acceptance.py).
#   bash scripts/ascend_acceptance.sh [OUT_DIR]
#   DRY_RUN=1 bash scripts/ascend_acceptance.sh [OUT_DIR]     # print every command, run nothing
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
if [[ -n "${DRY_RUN:-}" && "${DRY_RUN}" != "0" ]]; then
  exec python -m training.acceptance --dry-run "$@"
fi
exec python -m training.acceptance "$@"
