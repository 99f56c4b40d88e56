#!/usr/bin/env bash
# Acceptance run for an Ascend node with 8 devices (not run by this repository's CI, which has no NPU).
# Runs every Ascend claim (start-up of each shipped layout, layout agreement on the tiny recipe, BF16
# vs FP32, kill -9 and resume under TP/PP and under a DP-only optimizer-parallel layout (MindFormers' 7B DP 8 x TP 1),
# FlashAttention and fused RmsNorm against the math path at seq 2048, resume at another layout through
# MindFormers' auto_trans_ckpt, --to-hf of a TP/PP run merged with its strategy files, checkpoint size
# against the bytes resume needs, the pipeline run's logged loss, peak device memory next to --plan,
# throughput against the published figures, Mixture of Experts through MindFormers' MoELayer at expert parallel
# 1, 2 and 8 against each other and against the CPU math) and writes OUT/acceptance.json + OUT/acceptance.md with
# PASS / FAIL per check (training/tools/acceptance.py). Every compared run is deterministic (train_precision_sync:
# MindSpore's and HCCL's deterministic mode), and a resumed run must report the step it resumed from.
#   bash scripts/ascend_acceptance.sh [OUT_DIR]
#   DRY_RUN=1 bash scripts/ascend_acceptance.sh [OUT_DIR]     # print every command, run nothing
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"
require_package ascend_llm_recipes.training.tools.acceptance
if [[ -n "${DRY_RUN:-}" && "${DRY_RUN}" != "0" ]]; then
  exec "${PYTHON}" -m ascend_llm_recipes.training.tools.acceptance --dry-run "$@"
fi
exec "${PYTHON}" -m ascend_llm_recipes.training.tools.acceptance "$@"
