# Sourced by the scripts/*.sh entry points: find the Python that runs this checkout's package.
#   require_package MODULE
# sets PYTHON (python on PATH, else python3) once `import MODULE` works in it; otherwise prints the
# real import error with that Python's path and exits 2. Warns when the package that Python imports
# is not this checkout (another checkout, or a copy a non-editable `pip install .` made).

require_package() {
  local module="$1" checkout error installed
  checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
  PYTHON="$(command -v python || command -v python3 || true)"
  if [[ -z "${PYTHON}" ]]; then
    echo "error: no python or python3 on PATH; activate the environment ascend_llm_recipes is installed in," >&2
    echo "  or make one: python3 -m venv .venv && . .venv/bin/activate && pip install -e \"${checkout}\"" >&2
    exit 2
  fi
  if ! error="$("${PYTHON}" -c "import ${module}" 2>&1)"; then
    if grep -q "No module named 'ascend_llm_recipes'" <<<"${error}"; then
      echo "error: the ascend_llm_recipes package is not installed in this Python (${PYTHON});" >&2
      echo "  install it once from the repository root: pip install -e \"${checkout}\"" >&2
    else
      # The exception, then where it was raised (the traceback's last frame).
      local where
      where="$(grep '^  File ' <<<"${error}" | tail -n 1 | sed 's/^  File //' || true)"
      echo "error: ${PYTHON} cannot import ${module}: $(grep -v '^ ' <<<"${error}" | tail -n 1)" >&2
      [[ -z "${where}" ]] || echo "  raised at ${where}" >&2
      echo "  a dependency is missing or broken in this Python (pip install -e \"${checkout}\" installs them)," >&2
      echo "  or a file of yours shadows a module of that name (python puts the current directory first)" >&2
    fi
    exit 2
  fi
  # The installed package must be this checkout's, or other code would run without a word.
  installed="$("${PYTHON}" -c "import os, ascend_llm_recipes.training as t; print(os.path.dirname(os.path.dirname(os.path.realpath(t.__file__))))" 2>/dev/null || true)"
  if [[ -n "${installed}" && "${installed}" != "${checkout}" ]]; then
    if [[ -f "${installed}/scripts/run_distributed.sh" ]]; then
      echo "warning: this is ${checkout}, but ${PYTHON} imports ascend_llm_recipes from the checkout ${installed}: that checkout's code runs;" >&2
    else
      echo "warning: this is ${checkout}, but ${PYTHON} imports ascend_llm_recipes from ${installed}, a copy of the package installed without its checkout (\`pip install .\` without -e): that copy's code runs, and it has no scripts/ or recipes/;" >&2
    fi
    echo "  to run this checkout: pip install -e \"${checkout}\"" >&2
  fi
}
