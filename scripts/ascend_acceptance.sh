#!/usr/bin/env bash
# Acceptance run for an Ascend node with 8 devices (NOT run by this repository's CI, which has no NPU).
# Trains the tiny recipe twice with the same global batch of 8 sequences:
#   A: DP 2 x TP 2 x PP 2 (semi-auto parallel, 4 pipeline micro-batches of 1)
#   B: DP 8              (semi-auto parallel, micro-batch 1 per device)
# and checks that the per-step losses agree (float32 compute, so within 1e-3 relative).
#   bash scripts/ascend_acceptance.sh [OUT_DIR]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-${REPO_ROOT}/runs/ascend_acceptance}"
COMMON=(--set context.device_target=Ascend --set use_parallel=True --set parallel.parallel_mode=1
        --set hardware.device=Ascend910B2 --set hardware.devices_per_node=8
        --set model.model_config.compute_dtype=float32 --set runner_config.batch_size=1
        --set train_dataset.data_loader.shuffle=False --set runner_config.stop_step=20)

bash "${REPO_ROOT}/scripts/run_distributed.sh" "${REPO_ROOT}/recipes/tiny_cpu.yaml" "${COMMON[@]}" \
  --set output_dir="${OUT}/dp2_tp2_pp2" --set parallel_config.data_parallel=2 \
  --set parallel_config.model_parallel=2 --set parallel_config.pipeline_stage=2 \
  --set parallel_config.micro_batch_num=4

bash "${REPO_ROOT}/scripts/run_distributed.sh" "${REPO_ROOT}/recipes/tiny_cpu.yaml" "${COMMON[@]}" \
  --set output_dir="${OUT}/dp8" --set parallel_config.data_parallel=8

python - "${OUT}/dp2_tp2_pp2" "${OUT}/dp8" <<'PY'
import glob, json, sys

def step_losses(run_dir):
    """Per step, the mean of the losses reported by ranks that compute one (last pipeline stage)."""
    per_step = {}
    for path in glob.glob(f"{run_dir}/metrics*.jsonl"):
        for line in open(path):
            record = json.loads(line)
            if record["loss"]:
                per_step.setdefault(record["step"], []).append(record["loss"])
    return [sum(v) / len(v) for _, v in sorted(per_step.items())]

a, b = step_losses(sys.argv[1]), step_losses(sys.argv[2])
print("step  dp2xtp2xpp2  dp8")
for i, (x, y) in enumerate(zip(a, b), 1):
    print(f"{i:4d}  {x:11.6f}  {y:.6f}")
bad = [i for i, (x, y) in enumerate(zip(a, b), 1) if abs(x - y) > 1e-3 * max(abs(y), 1.0)]
if len(a) != len(b) or not a or bad:
    sys.exit(f"FAIL: losses disagree at steps {bad or 'count'} ({len(a)} vs {len(b)} steps)")
print(f"PASS: {len(a)} steps agree within 1e-3")
PY
