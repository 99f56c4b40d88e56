"""Convert checkpoints between HuggingFace (transformers) and this repository's Llama model.

    python scripts/convert_checkpoint.py --from-hf HF_DIR --output OUT_DIR [--verify] [--seq-length N]
    python scripts/convert_checkpoint.py --to-hf OUR_DIR_OR_CKPT --output HF_DIR [--model-config YAML]

--from-hf writes OUT_DIR/model.ckpt, model_config.yaml (a recipe's model: section) and
conversion.json; train from it with the recipe keys `load_checkpoint: OUT_DIR` and that model
section. --verify compares logits with transformers before anything is written.
--to-hf reads a converted directory, a run directory (its last checkpoint) or a .ckpt file.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.convert import from_hf, summary, to_hf  # noqa: E402
from training.errors import PretrainError  # noqa: E402
from training.preflight import check_writable_dir  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", help="HuggingFace model directory (config.json + weights)")
    direction.add_argument("--to-hf", metavar="OURS", help="converted directory, run directory or .ckpt file")
    parser.add_argument("--output", required=True, help="directory to create")
    parser.add_argument("--verify", action="store_true",
                        help="--from-hf: compare logits with transformers (float32, CPU) before writing")
    parser.add_argument("--seq-length", type=int,
                        help="--from-hf: model_config seq_length (default: max_position_embeddings, at most 4096)")
    parser.add_argument("--model-config", metavar="YAML",
                        help="--to-hf: recipe or model_config.yaml, when not found beside the checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.from_hf and args.model_config:
        parser.error("--model-config applies to --to-hf")
    if args.to_hf and (args.verify or args.seq_length):
        parser.error("--verify and --seq-length apply to --from-hf")
    try:
        check_writable_dir(args.output, "--output")
        if args.from_hf:
            manifest = from_hf(args.from_hf, args.output, seq_length=args.seq_length, verify=args.verify,
                               show_progress=not args.quiet)
        else:
            manifest = to_hf(args.to_hf, args.output, model_config=args.model_config, show_progress=not args.quiet)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary(manifest, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
