"""The training dashboard of a run, or of several runs compared, as one PNG.

    python scripts/plot_run.py runs/demo_cpu                  # -> runs/demo_cpu/plots/dashboard.png
    python scripts/plot_run.py runs/a runs/b [--output DIR]   # -> runs/a/plots/compare_a_b.png

Loss (EMA over the raw curve, held-out loss overlaid), learning rate, gradient norm (clip, loss
spikes, rollbacks), throughput and MFU, data wait; see training/tools/plots.py.
"""

import argparse
import os
import sys


from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.tools.plots import plot_runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--output", metavar="DIR", help="directory for the PNG (default: the first run's plots/)")
    parser.add_argument("--ema-span", type=int, metavar="STEPS",
                        help="smoothing of the loss, throughput and data-wait curves (default: a twentieth of the "
                             "run, 5 to 500 steps)")
    args = parser.parse_args(argv)
    if args.ema_span is not None and args.ema_span < 1:
        parser.error(f"--ema-span: need a number of steps >= 1, got {args.ema_span}")

    def warn(message):
        print("warning: " + message, file=sys.stderr)

    try:
        written = plot_runs(args.run_dirs, args.output or os.path.join(args.run_dirs[0], "plots"), args.ema_span,
                            log=warn)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. an output directory that cannot be written
        print(f"error: {err.filename or args.output}: {err.strerror}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
