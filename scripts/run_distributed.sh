#!/usr/bin/env bash
# Validate a recipe, prepare its dataset if needed, and train through msrun.
#   bash scripts/run_distributed.sh recipes/demo_cpu.yaml [--set key.path=value ...]
set -euo pipefail
if ! python -c "import ascend_llm_recipes.training" 2>/dev/null; then
  echo "error: the ascend_llm_recipes package is not installed in this Python ($(command -v python));" >&2
  echo "  install it once from the repository root: pip install -e \"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)\"" >&2
  exit 2
fi
# The installed package must be this checkout's, or another checkout's code would run without a word.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
INSTALLED="$(python -c "import os, ascend_llm_recipes.training as t; print(os.path.dirname(os.path.dirname(os.path.realpath(t.__file__))))" 2>/dev/null || true)"
if [[ -n "${INSTALLED}" && "${INSTALLED}" != "${HERE}" ]]; then
  echo "warning: this is ${HERE}, but python imports ascend_llm_recipes from ${INSTALLED}: that checkout's code runs;" >&2
  echo "  to run this one: pip install -e \"${HERE}\"" >&2
fi
exec python -m ascend_llm_recipes.training.launch "$@"
