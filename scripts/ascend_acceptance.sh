#!/usr/bin/env bash
# Acceptance run for an Ascend node with 8 devices (not run by this repository's CI, which has no NPU).
# Runs every Ascend claim (start-up of each shipped layout, layout agreement on the tiny recipe, BF16
# vs FP32, kill -9 and resume under TP/PP and under the 7B's DP-only optimizer-parallel layout,
# FlashAttention and fused RmsNorm against the math path at seq 2048, resume at another layout through
# MindFormers' auto_trans_ckpt, --to-hf of a TP/PP run merged with its strategy files, checkpoint size
# against the bytes resume needs, the pipeline run's logged loss, peak device memory next to --plan,
# throughput against the published figures) and writes OUT/acceptance.json + OUT/acceptance.md with
# PASS / FAIL per check (training/acceptance.py).
#   bash scripts/ascend_acceptance.sh [OUT_DIR]
#   DRY_RUN=1 bash scripts/ascend_acceptance.sh [OUT_DIR]     # print every command, run nothing
set -euo pipefail
if ! python -c "import ascend_llm_recipes.training" 2>/dev/null; then
  echo "error: the ascend_llm_recipes package is not installed in this Python ($(command -v python));" >&2
  echo "  install it once from the repository root: pip install -e \"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)\"" >&2
  exit 2
fi
if [[ -n "${DRY_RUN:-}" && "${DRY_RUN}" != "0" ]]; then
  exec python -m ascend_llm_recipes.training.acceptance --dry-run "$@"
fi
exec python -m ascend_llm_recipes.training.acceptance "$@"
