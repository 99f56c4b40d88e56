#!/usr/bin/env bash
# Validate a recipe, prepare its dataset if needed, and train through msrun.
#   bash scripts/run_distributed.sh recipes/demo_cpu.yaml [--set key.path=value ...]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
exec python -m training.launch "$@"
