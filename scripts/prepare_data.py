"""Build a packed MindRecord dataset (clean, dedup, sentencepiece, pack, shards + manifest).

    python scripts/prepare_data.py --output datasets/pystdlib-sp2048-s256 --seq-length 256 --vocab-size 2048
    python scripts/prepare_data.py --output DIR --seq-length 256 --input a.txt b.txt --tokenizer tok.model
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.prepare import prepare_dataset, summary  # noqa: E402
from training.errors import PretrainError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="dataset directory to create")
    parser.add_argument("--seq-length", type=int, required=True, help="model-visible length, a multiple of 16")
    parser.add_argument("--vocab-size", type=int, default=2048, help="vocabulary of a newly trained tokenizer")
    parser.add_argument("--tokenizer", help="use this sentencepiece .model instead of training one")
    parser.add_argument("--input", nargs="+", help="text files, one document each (default: the Python stdlib)")
    parser.add_argument("--max-documents", type=int, default=0, help="use only the first N documents")
    parser.add_argument("--samples-per-shard", type=int, default=4096)
    args = parser.parse_args(argv)
    try:
        manifest = prepare_dataset(args.output, args.seq_length, args.vocab_size, inputs=args.input,
                                   max_documents=args.max_documents, tokenizer=args.tokenizer,
                                   samples_per_shard=args.samples_per_shard)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary(args.output, manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
