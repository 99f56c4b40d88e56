"""Build a packed MindRecord dataset (clean, dedup, sentencepiece, pack, shards + manifest), or inspect one.

    python scripts/prepare_data.py --input 'web/*.jsonl.gz' --output datasets/web --seq-length 2048 --vocab-size 32000
    python scripts/prepare_data.py --input a.txt b.parquet --output DIR --seq-length 256 --tokenizer tok.model
    python scripts/prepare_data.py --input c.jsonl --output DIR --seq-length 4096 --tokenizer HF_OR_CONVERTED_DIR
    python scripts/prepare_data.py --output datasets/pystdlib-sp2048-s256 --seq-length 256   # the Python stdlib
    python scripts/prepare_data.py --from-megatron-indexed corpus_text_document --tokenizer tok.model --output DIR \
        --seq-length 4096                               # a Megatron .bin/.idx corpus, not re-tokenized
    python scripts/prepare_data.py --from-megatron-indexed web code --weights 0.7 0.3 --vocab-size 32000 \
        --eod-id 2 --output DIR --seq-length 4096       # two corpora blended by weight (samples, so tokens)
    python scripts/prepare_data.py --validate DIR [--recipe recipes/tiny_cpu.yaml]
    python scripts/prepare_data.py --report DIR
    python scripts/prepare_data.py --show DIR --sample 12

Inputs: .txt (one document per file; --lines: per line), .jsonl (--text-field), .parquet,
.txt.gz/.jsonl.gz; a file named or globbed with any other suffix is read as text. A folder is
read for its data files: its .jsonl/.parquet files, else its .txt files; the rest (README.md,
.gitattributes, dataset_info.json, hidden files) and anything prepare_data.py wrote (the output,
other datasets, reports) are listed as not read. An interrupted run (Ctrl-C exits 130, a
full disk exits 2), repeated with the same arguments, keeps its completed shards and
finishes the rest.

Text is normalised to NFC (CJK punctuation stays as written; --normalize NFKC folds
full-width forms to ASCII). --min-chars/--max-chars count a CJK character (Han, kana,
Hangul, full-width forms) as 3 characters, so the default 32 keeps a Chinese sentence of 11.
"""

import argparse
import errno
import os
import shlex
import sys
import traceback

try:
    from ascend_llm_recipes.common.errors import DataError, PretrainError
    from ascend_llm_recipes.training.launcher.preflight import check_writable_dir
except ModuleNotFoundError as missing:  # a Python without the package (or its dependencies): say how to get it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"error: {missing.name} is not installed in this Python ({sys.executable}): install the repository once "
          f"from its root: cd {shlex.quote(root)} && pip install -e .", file=sys.stderr)
    sys.exit(2)


TRAINED_VOCAB = 2048  # --vocab-size of a tokenizer trained on the corpus, when not given

# Errors from paths the user gave (permissions, read-only disks, a file where a directory belongs, a full disk).
USER_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENOSPC,
               errno.EDQUOT)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_argument_group("inspect a finished dataset (instead of building one)")
    modes.add_argument("--validate", metavar="DIR", help="check shards against the manifest (and --recipe)")
    modes.add_argument("--report", metavar="DIR", help="write DIR/report/report.txt and PNG plots")
    modes.add_argument("--report-output", metavar="OUT", help="with --report: write there instead")
    modes.add_argument("--show", metavar="DIR", help="decode a packed sample back to text (with --sample)")
    modes.add_argument("--sample", type=int, default=0, help="with --show: the sample index")

    build = parser.add_argument_group("build")
    build.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB",
                       help="files, globs or folders (a folder: its .jsonl/.parquet files, else its .txt files; default: "
                            "the Python standard library's source)")
    build.add_argument("--output", help="dataset directory to create")
    build.add_argument("--seq-length", type=int, help="model-visible length, a multiple of 16")
    build.add_argument("--vocab-size", type=int,
                       help=f"vocabulary of a newly trained tokenizer (default {TRAINED_VOCAB}); with "
                            "--from-megatron-indexed and no --tokenizer: the corpus's vocabulary")
    build.add_argument("--tokenizer", metavar="MODEL",
                       help="use this tokenizer instead of training one: a sentencepiece .model (any special ids), an "
                            "HF tokenizer.json, or the directory holding one (an HF model, or its conversion by "
                            "convert_checkpoint.py --from-hf); documents end with its end-of-text token")
    build.add_argument("--recipe", help="with --validate: check against this recipe; when building: take "
                                        "--seq-length from it and refuse a tokenizer that does not fit its model")
    build.add_argument("--text-field", default="text", help=".jsonl key / .parquet column holding the text")
    build.add_argument("--lines", action="store_true", help=".txt files hold one document per line")
    build.add_argument("--normalize", default="NFC", choices=["NFC", "NFKC", "none"],
                       help="Unicode normalisation (default NFC keeps CJK text as written; NFKC folds full-width "
                            "punctuation such as '，' to ASCII)")
    build.add_argument("--min-chars", type=int, default=32,
                       help="drop shorter documents; a CJK character counts as 3 characters")
    build.add_argument("--max-chars", type=int, default=0,
                       help="drop longer documents, counted like --min-chars (0: no limit)")
    build.add_argument("--invalid-utf8", default="drop", choices=["drop", "replace"],
                       help="documents with invalid UTF-8: drop them, or keep them with U+FFFD")
    build.add_argument("--near-dedup", action="store_true",
                       help="also remove near-duplicates: MinHash LSH candidates whose character 5-gram Jaccard "
                            "similarity is >= 0.8 (documents of 56+ distinct 5-grams), listed in "
                            "OUTPUT/near_duplicates.jsonl")
    build.add_argument("--packing", default="stream", choices=["stream", "best_fit"],
                       help="stream: documents continue across samples (no padding but the tail); "
                            "best_fit: whole documents per sample, padded")
    build.add_argument("--tail", default="pad", choices=["pad", "drop"], help="the last partial sample")
    build.add_argument("--val-fraction", type=float, default=0.0,
                       help="hold out this fraction of documents (by hash) into a validation dataset; "
                            "0 <= F < 0.5")
    build.add_argument("--val-output", help="validation dataset directory (default: OUTPUT-val)")
    build.add_argument("--max-documents", type=int, default=0, help="use only the first N documents")
    build.add_argument("--samples-per-shard", type=int, default=4096)
    build.add_argument("--workers", type=int, default=-1,
                       help="tokenizing processes (default: one per core, none for corpora under 8 MB); with "
                            "--tasks > 1: tasks running at once")
    build.add_argument("--tokenizer-sample-chars", type=int, default=32_000_000,
                       help="characters of text the tokenizer is trained on (a hash-chosen sample)")
    build.add_argument("--strict", action="store_true", help="stop at the first bad input instead of skipping it")
    build.add_argument("--no-progress", action="store_true")

    indexed = parser.add_argument_group("already tokenized: Megatron indexed corpora (PREFIX.bin + PREFIX.idx)")
    indexed.add_argument("--from-megatron-indexed", nargs="+", metavar="PREFIX",
                         help="pack these corpora (written by Megatron-LM / MindSpeed-LLM preprocess_data.py, NeMo, "
                              "megatron-core's IndexedDatasetBuilder) as they are: documents in order, one EOD after "
                              "each (none added where it already ends with it); stream packing")
    indexed.add_argument("--weights", nargs="+", type=float, metavar="W",
                         help="one weight per PREFIX, as Megatron's --data-path W1 P1 W2 P2: the share of samples "
                              "(so of tokens) drawn from each, one pass of as many samples as they hold together")
    indexed.add_argument("--eod-id", type=int, default=-1,
                         help="the corpus's end-of-document id (needed without --tokenizer; overrides the tokenizer's)")
    indexed.add_argument("--pad-id", type=int, default=-1,
                         help="padding id of the tail sample (default -1: none, masked from the loss; overrides the "
                              "tokenizer's)")

    scale = parser.add_argument_group("many machines (datatrove; pip install -e .[scale])")
    scale.add_argument("--executor", default="local", choices=["local", "slurm", "ray"],
                       help="where the tasks run (default local: this machine)")
    scale.add_argument("--tasks", type=int, default=1,
                       help="cut the input into this many ranges, each cleaned, tokenized and packed by its own task, "
                            "then merged into one dataset (the same documents as one task; samples depend on it)")
    scale.add_argument("--partition", help="Slurm partition")
    scale.add_argument("--time", help="Slurm time limit per task (default 24:00:00)")
    scale.add_argument("--cpus-per-task", type=int, help="Slurm CPUs per task (default 1)")
    scale.add_argument("--address", default="", help="Ray cluster address (default: start a local Ray)")
    scale.add_argument("--dry-run", action="store_true", help="with --executor slurm: print the sbatch scripts only")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.validate:
            from ascend_llm_recipes.data.inspection import validate_dataset
            from ascend_llm_recipes.training.recipe.loading import load_recipe
            model = load_recipe(args.recipe).model.model_config if args.recipe else None
            print(validate_dataset(args.validate, args.recipe, model))
        elif args.report:
            from ascend_llm_recipes.data.inspection import report_dataset
            text, plots = report_dataset(args.report, args.report_output)
            print(text + "\n\nplots: " + ", ".join(plots))
        elif args.show:
            from ascend_llm_recipes.data.inspection import show_sample
            print(show_sample(args.show, args.sample))
        else:
            return build(parser, args, argv)
    except PretrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue", file=sys.stderr, flush=True)
        return 130
    except Exception as err:  # noqa: BLE001 - anything else is our bug, and must say so
        if isinstance(err, OSError) and err.errno in USER_ERRNOS:
            print(f"error: {err.filename or ''}: {err.strerror}\n---> HINT: check the path and its permissions",
                  file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"internal error in prepare_data ({err.__class__.__name__}): a bug, not a problem with your input; "
              "please report it with the traceback above", file=sys.stderr)
        return 1
    return 0


def build(parser: argparse.ArgumentParser, args, argv) -> int:
    from ascend_llm_recipes.data.prepare import prepare_dataset, summary

    model_vocab = 0
    if args.recipe:
        from ascend_llm_recipes.training.recipe.loading import load_recipe
        model = load_recipe(args.recipe).model.model_config
        args.seq_length = args.seq_length or model.seq_length
        model_vocab = model.vocab_size
    if not args.output or not args.seq_length:
        parser.error("building a dataset needs --output and --seq-length (or --recipe)")
    misplaced = [problem for applies, problem in (
        (not args.dry_run or args.executor == "slurm", "--dry-run applies to --executor slurm"),
        (not args.address or args.executor == "ray", "--address applies to --executor ray"),
        (args.executor == "slurm" or (args.partition, args.time, args.cpus_per_task) == (None, None, None),
         "--partition/--time/--cpus-per-task apply to --executor slurm"),
    ) if not applies]
    if misplaced:
        raise DataError("; ".join(misplaced), hint="fix the arguments; nothing was written")
    check_writable_dir(args.output, "--output")
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(shlex.quote(a) for a in ["python", "scripts/prepare_data.py", *given])
    if args.from_megatron_indexed or args.weights or args.eod_id != -1 or args.pad_id != -1:
        return build_indexed(parser, args, command, model_vocab)
    manifest = prepare_dataset(
        args.output, args.seq_length, TRAINED_VOCAB if args.vocab_size is None else args.vocab_size,
        inputs=args.input, max_documents=args.max_documents,
        tokenizer=args.tokenizer, samples_per_shard=args.samples_per_shard, show_progress=not args.no_progress,
        text_field=args.text_field, lines=args.lines, normalization=args.normalize, min_chars=args.min_chars,
        max_chars=args.max_chars, invalid_utf8=args.invalid_utf8, near_dedup=args.near_dedup, packing=args.packing,
        tail=args.tail, val_fraction=args.val_fraction, val_output=args.val_output or "", strict=args.strict,
        workers=args.workers, tokenizer_sample_chars=args.tokenizer_sample_chars, model_vocab_size=model_vocab,
        command=command, executor=args.executor, tasks=args.tasks,
        cluster={"partition": args.partition or "", "time": args.time or "24:00:00",
                 "cpus_per_task": 1 if args.cpus_per_task is None else args.cpus_per_task,
                 "address": args.address,
                 "dry_run": args.dry_run} if args.executor != "local" else None)
    if manifest is not None:  # None: Slurm jobs submitted, or their scripts printed
        print(summary(args.output, manifest))
    return 0


# Options of the text path: given with --from-megatron-indexed they would be silently ignored.
TEXT_ONLY = ("input", "text_field", "lines", "normalize", "min_chars", "max_chars", "invalid_utf8", "near_dedup",
             "packing", "max_documents", "tokenizer_sample_chars", "strict")


def build_indexed(parser: argparse.ArgumentParser, args, command: str, model_vocab: int) -> int:
    from ascend_llm_recipes.data.indexed.prepare import IndexedOptions, indexed_summary, prepare_indexed

    if not args.from_megatron_indexed:
        raise DataError("--weights/--eod-id/--pad-id apply to --from-megatron-indexed",
                        hint="add --from-megatron-indexed PREFIX ..., or drop them; nothing was written")
    text_only = [f"--{name.replace('_', '-')}" for name in TEXT_ONLY
                 if getattr(args, name) != parser.get_default(name)]
    if text_only:
        raise DataError(f"{', '.join(text_only)} appl{'ies' if len(text_only) == 1 else 'y'} to text input, not to "
                        "--from-megatron-indexed (its documents are tokenized already and stream-packed)",
                        hint="drop them; nothing was written")
    opts = IndexedOptions(
        prefixes=tuple(args.from_megatron_indexed), seq_length=args.seq_length, weights=tuple(args.weights or ()),
        tokenizer=args.tokenizer or "", vocab_size=args.vocab_size or 0, eod_id=args.eod_id, pad_id=args.pad_id,
        tail=args.tail, val_fraction=args.val_fraction, val_output=args.val_output or "",
        samples_per_shard=args.samples_per_shard, model_vocab_size=model_vocab, command=command)
    manifest = prepare_indexed(
        args.output, opts, executor=args.executor, tasks=args.tasks, workers=args.workers,
        cluster={"partition": args.partition or "", "time": args.time or "24:00:00",
                 "cpus_per_task": 1 if args.cpus_per_task is None else args.cpus_per_task,
                 "address": args.address, "dry_run": args.dry_run} if args.executor != "local" else None)
    if manifest is not None:
        print(indexed_summary(args.output, manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
