"""Build a packed MindRecord dataset from raw documents, and check one against a recipe.

This is the simple whole-corpus-in-memory version (fine for the demo corpus of ~12 MB);
the output format, the manifest and the atomic completion are the lasting parts.
"""

import os
import shutil

from tqdm import tqdm

from data.clean import CleanStats, clean_documents
from data.corpus import python_stdlib_files, read_documents
from data.mindrecord_io import (MANIFEST, check_files_present, finalize, partial_dir, read_manifest,
                                remove_partial, write_shards)
from data.packing import PackStats, pack_documents
from data.tokenizer import BOS_ID, EOD_ID, PAD_ID, UNK_ID, file_sha256, load_tokenizer, train_tokenizer
from training.errors import DataError

SEQ_ALIGN = 16
ENCODE_BATCH = 256


def prepare_command(output_dir: str, seq_length: int, vocab_size: int) -> str:
    """The command line that (re)builds a dataset; used in hints."""
    return (f"python scripts/prepare_data.py --output {output_dir} --seq-length {seq_length} "
            f"--vocab-size {vocab_size}")


def source_files(source: str, inputs=None) -> list:
    if inputs:
        missing = [p for p in inputs if not os.path.isfile(p)]
        if missing:
            raise DataError(f"input file {missing[0]} does not exist ({len(missing)} missing in all)")
        return sorted(inputs)
    if source == "python_stdlib":
        return python_stdlib_files()
    raise DataError(f"unknown data source {source!r}", hint="use python_stdlib or pass input files")


def prepare_dataset(output_dir: str, seq_length: int, vocab_size: int = 2048, source: str = "python_stdlib",
                    inputs=None, max_documents: int = 0, tokenizer: str = None,
                    samples_per_shard: int = 4096, show_progress: bool = True) -> dict:
    """Clean, deduplicate, tokenise and pack documents into `output_dir`; returns the manifest."""
    if seq_length % SEQ_ALIGN:
        raise DataError(f"seq_length {seq_length} is not a multiple of {SEQ_ALIGN}",
                        hint=f"use {-(-seq_length // SEQ_ALIGN) * SEQ_ALIGN}")
    if os.path.exists(output_dir):
        if os.path.isfile(os.path.join(output_dir, MANIFEST)):
            raise DataError(f"dataset {output_dir} already exists (complete)",
                            hint="reuse it, or choose another --output")
        raise DataError(f"{output_dir} exists but is not a complete dataset (no {MANIFEST})",
                        hint="remove it or choose another --output; nothing was written")
    files = source_files(source, inputs)
    if max_documents:
        files = files[:max_documents]
    remove_partial(output_dir)
    work = partial_dir(output_dir)
    os.makedirs(work)
    try:
        clean_stats = CleanStats()
        docs = list(clean_documents(read_documents(files), clean_stats))
        if not docs:
            raise DataError(f"no usable document among {len(files)} input files", hint="check the inputs")
        if tokenizer:
            tokenizer_path = shutil.copyfile(tokenizer, os.path.join(work, "tokenizer.model"))
        else:
            tokenizer_path = train_tokenizer(docs, vocab_size, os.path.join(work, "tokenizer"))
            for scratch in ("tokenizer.sample.txt", "tokenizer.vocab"):
                os.remove(os.path.join(work, scratch))
        sp = load_tokenizer(tokenizer_path)
        pack_stats = PackStats()
        progress = tqdm(total=len(docs), unit="doc", desc="tokenize+pack", disable=not show_progress)

        def token_docs():
            for start in range(0, len(docs), ENCODE_BATCH):
                batch = docs[start:start + ENCODE_BATCH]
                yield from sp.encode(batch, num_threads=os.cpu_count() or 1)
                progress.update(len(batch))

        rows = pack_documents(token_docs(), seq_length, EOD_ID, PAD_ID, pack_stats)
        shards = write_shards(rows, work, samples_per_shard)
        progress.close()
        manifest = {
            "source": source if not inputs else "files",
            "inputs": {"files": len(files)},
            "documents": clean_stats.as_dict(),
            "tokenizer": {"file": "tokenizer.model", "sha256": file_sha256(tokenizer_path),
                          "vocab_size": sp.get_piece_size(), "unk_id": UNK_ID, "bos_id": BOS_ID,
                          "eod_id": EOD_ID, "pad_id": PAD_ID},
            "seq_length": seq_length,
            "sample_length": seq_length + 1,
            "samples": pack_stats.samples,
            "tokens": pack_stats.tokens,
            "padding_tokens": pack_stats.padding_tokens,
            "padding_rate": round(pack_stats.padding_rate, 8),
            "shards": shards,
        }
        finalize(work, output_dir, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def summary(output_dir: str, manifest: dict) -> str:
    d = manifest["documents"]
    return (f"dataset {output_dir}: {d['kept']} of {d['read']} documents kept ({d['duplicates']} duplicates, "
            f"{d['invalid_utf8']} invalid UTF-8, {d['too_short']} too short), {manifest['tokens']:,} tokens "
            f"in {manifest['samples']:,} samples of {manifest['sample_length']} tokens, "
            f"{len(manifest['shards'])} shard(s), padding {manifest['padding_rate']:.4%}, "
            f"vocabulary {manifest['tokenizer']['vocab_size']}.")


def check_dataset(dataset_dir: str, seq_length: int, vocab_size: int, pad_token_id: int,
                  eos_token_id: int) -> dict:
    """Refuse a dataset that is missing, incomplete, or built for another model shape."""
    try:
        manifest = read_manifest(dataset_dir)
        check_files_present(dataset_dir, manifest)
    except DataError as err:
        raise DataError(f"train_dataset.data_loader.dataset_dir: {err.message}",
                        hint=f"build it with: {prepare_command(dataset_dir, seq_length, vocab_size)}") from None
    problems = []
    if manifest["seq_length"] != seq_length:
        problems.append(f"seq_length {manifest['seq_length']} (model.model_config.seq_length is {seq_length})")
    tok = manifest["tokenizer"]
    if tok["vocab_size"] > vocab_size:
        problems.append(f"tokenizer vocab_size {tok['vocab_size']} exceeds model.model_config.vocab_size "
                        f"{vocab_size}")
    if tok["pad_id"] != pad_token_id:
        problems.append(f"pad_id {tok['pad_id']} (model.model_config.pad_token_id is {pad_token_id})")
    if tok["eod_id"] != eos_token_id:
        problems.append(f"eod_id {tok['eod_id']} (model.model_config.eos_token_id is {eos_token_id})")
    if problems:
        raise DataError(f"dataset {dataset_dir} was built for another model: " + "; ".join(problems),
                        hint="fix the recipe, or build a matching dataset with: "
                             f"{prepare_command('NEW_DIR', seq_length, vocab_size)} and set "
                             "train_dataset.data_loader.dataset_dir to NEW_DIR")
    return manifest
