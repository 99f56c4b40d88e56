"""Build a packed MindRecord dataset from raw documents, and check one against a recipe.

`prepare_dataset` is the whole chain (data/text/pipeline.py runs it: streaming, parallel,
restartable); `check_dataset` is what the launcher asks before training.
"""

import contextlib
import fcntl
import os
import shlex
import sys

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.text.corpus import python_stdlib_files
from ascend_llm_recipes.data.text.inputs import expand_inputs, written_paths
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, check_files_present, lock_path, read_manifest
from ascend_llm_recipes.data.text.pipeline import PrepareOptions, prepare_local
from ascend_llm_recipes.data.run_state import Job, val_output_dir
from ascend_llm_recipes.data.tokenizer import EOD_ID, PAD_ID
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up

SOURCES = ("python_stdlib",)
SKIPPED_SHOWN = 20  # skipped inputs printed before the run (the manifest lists them all)

# PrepareOptions field -> command-line flag, for commands rebuilt from a manifest.
FLAGS = {"text_field": "--text-field", "lines": "--lines", "normalization": "--normalize",
         "min_chars": "--min-chars", "max_chars": "--max-chars", "invalid_utf8": "--invalid-utf8",
         "near_dedup": "--near-dedup", "packing": "--packing", "tail": "--tail", "val_fraction": "--val-fraction",
         "tokenizer_sample_chars": "--tokenizer-sample-chars"}


def prepare_command(output_dir: str, seq_length: int, vocab_size: int) -> str:
    """The command line that (re)builds a dataset; used in hints."""
    return (f"python scripts/prepare_data.py --output {output_dir} --seq-length {seq_length} "
            f"--vocab-size {vocab_size}")


def rerun_command(manifest: dict, output_dir: str, seq_length: int = None, vocab_size: int = None) -> str:
    """The command that builds `manifest`'s dataset again, with another output (and seq_length/vocabulary)."""
    if manifest.get("source") == "megatron_indexed":
        from ascend_llm_recipes.data.indexed.prepare import indexed_command
        return indexed_command(manifest, output_dir, seq_length, vocab_size)
    args = manifest.get("arguments", {})
    seq_length = seq_length or manifest["seq_length"]
    parts = ["python", "scripts/prepare_data.py", "--output", output_dir, "--seq-length", str(seq_length)]
    tokenizer = args.get("tokenizer")
    if tokenizer and (vocab_size is None or manifest["tokenizer"]["vocab_size"] <= vocab_size):
        parts += ["--tokenizer", tokenizer]
    else:
        parts += ["--vocab-size", str(vocab_size or manifest["tokenizer"]["vocab_size"])]
    inputs = args.get("inputs") or []
    if inputs:
        parts += ["--input", *inputs[:20]] + (["..."] if len(inputs) > 20 else [])
    if args.get("max_documents"):
        parts += ["--max-documents", str(args["max_documents"])]
    defaults = PrepareOptions()
    for name, flag in FLAGS.items():
        value = args.get(name, getattr(defaults, name))
        if value != getattr(defaults, name):
            parts += [flag] if isinstance(value, bool) else [flag, str(value)]
    return " ".join(p if p == "..." else shlex.quote(p) for p in parts)


def prepare_dataset(output_dir: str, seq_length: int, vocab_size: int = 2048, source: str = "python_stdlib",
                    inputs=None, max_documents: int = 0, tokenizer: str = None, samples_per_shard: int = 4096,
                    show_progress: bool = True, executor: str = "local", tasks: int = 1, cluster: dict = None,
                    **options) -> dict:
    """Clean, deduplicate, tokenise and pack documents into `output_dir`; returns the manifest.

    inputs: paths, globs or directories (default: the `source` corpus). `options` are the
    fields of data.text.pipeline.PrepareOptions (input format, filters, near-dedup, packing,
    validation split, workers, --strict). An interrupted run, repeated with the same
    arguments, continues from its last completed shard.

    executor/tasks: with more than one task or another executor than "local", the run is cut into
    `tasks` ranges run by datatrove (data/cluster/scale.py); `workers` is then the number of tasks at once and
    `cluster` holds data.cluster.executors.ClusterOptions' scheduler fields (partition, time, cpus_per_task, address,
    dry_run). Needs the `scale` extra.
    """
    opts = PrepareOptions(**options)
    problems = opts.problems()
    scaled = executor != "local" or tasks != 1
    if scaled:
        from ascend_llm_recipes.data.cluster.executors import ClusterOptions
        cluster = ClusterOptions(executor=executor, tasks=tasks, workers=opts.workers, **(cluster or {}))
        problems += cluster.problems()
        if max_documents:
            problems.append("--max-documents needs the single-process run (--executor local --tasks 1)")
    if seq_length <= 0:
        raise DataError(f"seq_length {seq_length} must be positive", hint="pass --seq-length, e.g. 2048")
    if seq_length % ALIGN:
        raise DataError(f"seq_length {seq_length} is not a multiple of {ALIGN}",
                        hint=f"use {round_up(seq_length, ALIGN)}")
    if not tokenizer and vocab_size % ALIGN:
        problems.append(f"vocab_size {vocab_size} is not a multiple of {ALIGN}; use "
                        f"{round_up(vocab_size, ALIGN)}")
    if not tokenizer and opts.model_vocab_size and vocab_size > opts.model_vocab_size:
        problems.append(f"vocab_size {vocab_size} does not fit model.model_config.vocab_size "
                        f"{opts.model_vocab_size}")
    if tokenizer and not os.path.exists(tokenizer):
        problems.append(f"tokenizer {tokenizer} does not exist")
    if samples_per_shard < 1:
        problems.append(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    if problems:
        raise DataError("; ".join(problems), hint="fix the arguments; nothing was written")
    skipped = []
    if inputs:
        found = expand_inputs(list(inputs), written_paths(output_dir, val_output_dir(output_dir, opts.val_output)))
        files, missing, skipped = found.files, found.problems, found.skipped
        source = "files"
    elif source in SOURCES:
        files, missing = [str(p) for p in python_stdlib_files()], []
    else:
        raise DataError(f"unknown data source {source!r}", hint="use python_stdlib or pass input files")
    if not files:
        raise DataError(f"no input file found: {missing[0][0]}: {missing[0][1]}" +
                        (f" ({len(missing)} in all)" if len(missing) > 1 else ""),
                        hint="check the --input paths and patterns; nothing was written")
    if skipped:
        print(f"prepare: reading {len(files)} input file(s); not reading {len(skipped)} path(s) in the input folders "
              f"(listed in the manifest's inputs.skipped):\n" +
              "".join(f"  {path}: {reason}\n" for path, reason in skipped[:SKIPPED_SHOWN]) +
              (f"  ... and {len(skipped) - SKIPPED_SHOWN} more\n" if len(skipped) > SKIPPED_SHOWN else ""),
              end="", file=sys.stderr, flush=True)
    if missing:
        listed = "; ".join(f"{path}: {reason}" for path, reason in missing[:3]) + (" ..." if len(missing) > 3 else "")
        if opts.strict:
            raise DataError(f"bad input: {listed}", hint="fix or remove it, or run without --strict to skip such "
                                                         "input (it is counted in the manifest); nothing was written")
        print(f"prepare: skipping {len(missing)} unreadable input(s), counted in the manifest (--strict stops "
              f"instead): {listed}", file=sys.stderr, flush=True)
    with output_lock(output_dir):
        return _prepare(output_dir, seq_length, vocab_size, source, inputs, files, missing, max_documents, tokenizer,
                        samples_per_shard, show_progress, opts, scaled, tasks, cluster, skipped)


@contextlib.contextmanager
def output_lock(output_dir: str):
    """Hold OUTPUT.lock (an flock, gone with its holder even after kill -9) so that two runs never write one output;
    the file names the holder's PID and is removed on release."""
    path = lock_path(output_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DataError(f"{output_dir} is being prepared by {holder} (lock {path})",
                            hint="wait for that run to finish or stop it, or choose another --output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and flock: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.unlink(path)  # while still holding it: a run waiting on this inode re-checks and takes the new file
        os.close(fd)


def _prepare(output_dir, seq_length, vocab_size, source, inputs, files, missing, max_documents, tokenizer,
             samples_per_shard, show_progress, opts, scaled, tasks, cluster, skipped) -> dict:
    """prepare_dataset's work once its arguments are checked and the output is locked."""
    arguments = (output_dir, seq_length, vocab_size, source, [str(p) for p in inputs or []], files, missing,
                 max_documents, tokenizer, samples_per_shard, show_progress, opts)
    if scaled:
        from dataclasses import replace

        from ascend_llm_recipes.data.cluster.scale import prepare_scaled
        # Each task processes its range in its own process; parallelism is the number of tasks at once.
        arguments = arguments[:-1] + (replace(opts, workers=0),)
        return prepare_scaled(Job(*arguments, tasks=tasks, skipped=skipped), cluster)
    return prepare_local(Job(*arguments, skipped=skipped))


def summary(output_dir: str, manifest: dict) -> str:
    """One paragraph: what was kept, filtered and written."""
    if manifest.get("source") == "megatron_indexed":
        from ascend_llm_recipes.data.indexed.prepare import indexed_summary
        return indexed_summary(output_dir, manifest)
    d = manifest["documents"]
    extra = "".join(f", {d[key]} {label}" for key, label in (("too_long", "too long"),
                                                             ("near_duplicates", "near-duplicates"),
                                                             ("malformed_json", "malformed JSON"),
                                                             ("missing_field", "without text field"))
                    if d.get(key))
    text = (f"dataset {output_dir}: {d['kept']} of {d['read']} documents kept ({d['duplicates']} duplicates, "
            f"{d['invalid_utf8']} invalid UTF-8, {d['too_short']} too short{extra}), {manifest['tokens']:,} tokens "
            f"in {manifest['samples']:,} samples of {manifest['sample_length']} tokens, "
            f"{len(manifest['shards'])} shard(s), padding {manifest['padding_rate']:.4%}, "
            f"vocabulary {manifest['tokenizer']['vocab_size']}.")
    tok = manifest["tokenizer"]
    if tok.get("kind"):
        text += (f" Tokenizer: {tok['kind']}, documents end with {tok['eod_token']!r} (id {tok['eod_id']}), "
                 f"padding id {tok['pad_id']}" + (" (no pad token: masked from the loss)" if tok["pad_id"] < 0 else "")
                 + ".")
    if tok.get("vocab_note"):
        text += f" Vocabulary {tok['vocab_note']}."
    bad = {k: v for k, v in manifest.get("bad_input", {}).get("counts", {}).items() if v}
    if bad:
        first = manifest["bad_input"]["first"]
        text += " Skipped bad input: " + "; ".join(f"{n} {kind} (first: {first[kind]})" for kind, n in bad.items())
        text += "."
    skipped = manifest.get("inputs", {}).get("skipped")
    if skipped:
        text += f" Not read: {len(skipped)} path(s) in the input folders (inputs.skipped in {MANIFEST})."
    if manifest.get("validation"):
        v = manifest["validation"]
        text += (f" Validation: {v['documents']} documents held out, {v['tokens']:,} tokens in {v['samples']:,} "
                 f"samples in {validation_dir(output_dir, manifest)}.")
    return text


def validation_dir(dataset_dir: str, manifest: dict):
    """The validation dataset written with this one (--val-fraction), or None."""
    validation = manifest.get("validation")
    return os.path.normpath(os.path.join(dataset_dir, validation["dataset_dir"])) if validation else None


def check_dataset(dataset_dir: str, seq_length: int, vocab_size: int, pad_token_id: int,
                  eos_token_id: int) -> dict:
    """Refuse a dataset that is missing, incomplete, or built for another model shape."""
    try:
        manifest = read_manifest(dataset_dir)
        check_files_present(dataset_dir, manifest)
    except DataError as err:
        raise DataError(f"train_dataset.data_loader.dataset_dir: {err.message}",
                        hint=f"build it with: {prepare_command(dataset_dir, seq_length, vocab_size)}") from None
    problems = model_mismatches(manifest, seq_length, vocab_size, pad_token_id, eos_token_id)
    if problems:
        raise DataError(f"dataset {dataset_dir} was built for another model: " + "; ".join(problems),
                        hint=fit_hint(manifest, seq_length, vocab_size, pad_token_id, eos_token_id, "the recipe",
                                      "NEW_DIR", " and set train_dataset.data_loader.dataset_dir to NEW_DIR"))
    return manifest


def fit_hint(manifest: dict, seq_length: int, vocab_size: int, pad_token_id: int, eos_token_id: int,
             config: str, new_dir: str, then: str = "") -> str:
    """What to do when `manifest` does not fit the model (model_mismatches found something).

    A dataset's ids and vocabulary are its tokenizer's: rebuilding with the same tokenizer gives them again, so
    the recipe values that fit come first; then a dataset to build instead, when one would fit the recipe.
    config: how to name the recipe (or the file setting the model's values); new_dir: the rebuilt dataset's
    directory; then: appended after a command.
    """
    tok = manifest["tokenizer"]
    values = {key: value for key, value, differs in (
        ("pad_token_id", tok["pad_id"], tok["pad_id"] != pad_token_id),
        ("eos_token_id", tok["eod_id"], tok["eod_id"] != eos_token_id),
        ("vocab_size", tok["vocab_size"], tok["vocab_size"] > vocab_size)) if differs}
    seq = manifest["seq_length"]
    if not values:
        return (f"build a dataset for this recipe with: {rerun_command(manifest, new_dir, seq_length, vocab_size)}"
                f"{then}; or set model.model_config.seq_length: {seq} in {config} (or launch with --set "
                f"model.model_config.seq_length={seq})")
    hint = (f"set in {config}, under model: model_config: {', '.join(f'{k}: {v}' for k, v in values.items())} "
            f"(or launch with {' '.join(f'--set model.model_config.{k}={v}' for k, v in values.items())})")
    if seq != seq_length:
        hint += (f", and build the dataset again for seq_length {seq_length} with: "
                 f"{rerun_command(manifest, new_dir, seq_length, max(vocab_size, tok['vocab_size']))}{then}")
    if manifest.get("source") == "megatron_indexed":
        return hint + " (the corpus's token ids are fixed: the recipe must take them)"
    if "pad_token_id" in values or "eos_token_id" in values:
        hint += (f"; or keep the recipe's ids and build the dataset with a tokenizer whose end-of-text id is "
                 f"{eos_token_id} and padding id {pad_token_id} (the same tokenizer gives the same ids)")
        if (eos_token_id, pad_token_id) == (EOD_ID, PAD_ID) and manifest.get("arguments", {}).get("tokenizer"):
            retrained = {**manifest, "arguments": {**manifest["arguments"], "tokenizer": None}}
            hint += (f", e.g. one trained on the corpus: {rerun_command(retrained, new_dir, seq_length, vocab_size)}"
                     f"{then}")
    else:  # a vocabulary larger than the model's: a tokenizer trained to the model's size fits
        hint += f"; or build it with a tokenizer of the model's size: " \
                f"{rerun_command(manifest, new_dir, seq_length, vocab_size)}{then}"
    return hint


def model_mismatches(manifest: dict, seq_length: int, vocab_size: int, pad_token_id: int,
                     eos_token_id: int) -> list:
    """Where a dataset's manifest disagrees with a model config (empty when it fits)."""
    problems = []
    if manifest["seq_length"] != seq_length:
        problems.append(f"seq_length {manifest['seq_length']} (model.model_config.seq_length is {seq_length})")
    tok = manifest["tokenizer"]
    if tok["vocab_size"] > vocab_size:
        problems.append(f"tokenizer vocab_size {tok['vocab_size']} exceeds model.model_config.vocab_size "
                        f"{vocab_size}")
    if tok["pad_id"] != pad_token_id:
        why = (f"; the tokenizer has no pad token: set pad_token_id to -1, or every label {pad_token_id} (a real "
               "token) is dropped from the loss" if tok["pad_id"] < 0 else "")
        problems.append(f"pad_id {tok['pad_id']} (model.model_config.pad_token_id is {pad_token_id}{why})")
    if tok["eod_id"] != eos_token_id:
        problems.append(f"eod_id {tok['eod_id']} (model.model_config.eos_token_id is {eos_token_id})")
    return problems
