"""Plot loss, LR, tokens/s, grad norm and data wait against step for one or more runs.

    python scripts/plot_run.py runs/demo_cpu [runs/other ...] [--output DIR]

PNGs go to DIR (default: the first run's plots/ directory).
"""

import argparse
import os
import sys


from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.plots import plot_runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--output", help="directory for the PNGs (default RUN_DIR/plots of the first run)")
    args = parser.parse_args(argv)
    try:
        written = plot_runs(args.run_dirs, args.output or os.path.join(args.run_dirs[0], "plots"))
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. an output directory that cannot be written
        print(f"error: {err.filename or args.output}: {err.strerror}", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
