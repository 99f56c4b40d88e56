"""Build a simulated CANN (no-op libraries) so that `--check --dry-run` compiles Ascend recipes on any x86/Arm host.

    python scripts/make_simulated_cann.py DIR
    eval "$(python scripts/make_simulated_cann.py DIR --print-env)"    # once built: export its variables

See training/tools/simulated_cann.py for what it holds and what a DryRun under it does and does not show.
"""

import argparse
import os
import shlex
import sys

from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.training.tools import simulated_cann


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="folder to create (must not exist), or an existing tree with --print-env")
    parser.add_argument("--soc", default=simulated_cann.SOC_NAME, help="SoC name the runtime reports "
                        f"(default {simulated_cann.SOC_NAME})")
    parser.add_argument("--print-env", action="store_true", help="only print the export line of an existing tree")
    args = parser.parse_args(argv)
    try:
        if not args.print_env:
            simulated_cann.build(args.dir, args.soc)
        elif not os.path.isdir(os.path.join(args.dir, "latest", "lib64")):
            raise PretrainError(f"{args.dir}: not a simulated CANN tree", hint=f"build it first: python "
                                f"scripts/make_simulated_cann.py {shlex.quote(args.dir)}")
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = simulated_cann.merged_environment(os.path.abspath(args.dir))
    print("export " + " ".join(f"{k}={shlex.quote(env[k])}" for k in simulated_cann.environment(args.dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
