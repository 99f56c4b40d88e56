#!/usr/bin/env bash
# Validate a recipe, prepare its dataset if needed, and train through msrun (a one-process CPU run:
# the worker alone, started without msrun).
#   bash scripts/run_distributed.sh recipes/demo_cpu.yaml [--set key.path=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"
require_package ascend_llm_recipes.training.launcher.cli
exec "${PYTHON}" -m ascend_llm_recipes.training.launcher.cli "$@"
