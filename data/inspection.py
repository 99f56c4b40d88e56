"""Look at a finished dataset: validate it, report on it, decode a sample.

    python scripts/prepare_data.py --validate DIR [--recipe R]
    python scripts/prepare_data.py --report DIR [--report-output OUT]
    python scripts/prepare_data.py --show DIR --sample I
"""

import os

import numpy as np
from mindspore.mindrecord import FileReader

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.data.mindrecord_io import (MANIFEST, PADDING_PLOT, REPORT_DIR, REPORT_TEXT, indexes_hashed,
                                                   open_problem, read_manifest)
from ascend_llm_recipes.data.prepare import fit_hint, model_mismatches, rerun_command, summary, validation_dir
from ascend_llm_recipes.data.tokenizer import load_tokenizer

EOD_MARK = "\n<|EOD|>\n"


def validate_dataset(dataset_dir: str, recipe_path: str = None, model=None) -> str:
    """Check shards against the manifest (sha256, sample counts, sample length), the tokenizer file, the
    validation dataset, and optionally the recipe's model (its model.model_config, loaded by the caller);
    returns a report or raises DataError naming every problem and the command to rerun."""
    manifest = read_manifest(dataset_dir)
    problems = _file_problems(dataset_dir, manifest)
    lines = [f"dataset {dataset_dir}: {len(manifest['shards'])} shard(s), {manifest['samples']:,} samples of "
             f"{manifest['sample_length']} tokens"]
    val_dir = validation_dir(dataset_dir, manifest)
    if val_dir:
        try:
            problems += [f"validation dataset {val_dir}: {p}" for p in _file_problems(val_dir,
                                                                                      read_manifest(val_dir))]
            lines.append(f"validation dataset {val_dir}: {manifest['validation']['samples']:,} samples")
        except DataError as err:
            problems.append(f"validation dataset: {err.message}")
    hint = f"rebuild it with: {rerun_command(manifest, dataset_dir + '-new')}"
    if model is not None:
        mismatches = model_mismatches(manifest, model.seq_length, model.vocab_size, model.pad_token_id,
                                      model.eos_token_id)
        problems += [f"recipe {recipe_path}: {m}" for m in mismatches]
        if mismatches:
            hint = fit_hint(manifest, model.seq_length, model.vocab_size, model.pad_token_id, model.eos_token_id,
                            recipe_path, dataset_dir + "-new")
        else:
            lines.append(f"matches recipe {recipe_path} (seq_length {model.seq_length}, vocabulary "
                         f"{manifest['tokenizer']['vocab_size']} <= {model.vocab_size}, pad/EOD ids)")
    if problems:
        raise DataError(f"dataset {dataset_dir}: {len(problems)} problem(s):\n" +
                        "\n".join(f"  - {p}" for p in problems), hint=hint)
    if indexes_hashed(manifest):
        lines.append(f"OK: every shard and its .db index match their sha256, and the sample counts in {MANIFEST}")
    else:
        lines.append(f"OK: every shard matches its sha256 and sample count in {MANIFEST}; the .db index files were "
                     f"opened but are not covered by hashes ({MANIFEST} predates them: rebuild to cover them)")
    return "\n".join(lines)


def _file_problems(dataset_dir: str, manifest: dict) -> list:
    problems = []
    for shard in manifest["shards"]:
        path = os.path.join(dataset_dir, shard["file"])
        missing = [name for name in (path, path + ".db") if not os.path.isfile(name)]
        if missing:
            problems.append(f"{os.path.basename(missing[0])} listed in {MANIFEST} is missing")
            continue
        if file_sha256(path) != shard["sha256"]:
            problems.append(f"{shard['file']} does not match its sha256 (modified or corrupt)")
            continue
        if "db_sha256" in shard and file_sha256(path + ".db") != shard["db_sha256"]:
            problems.append(f"{shard['file']}.db (its MindRecord index) does not match its sha256 (modified or "
                            "corrupt)")
            continue
        problem = open_problem(path)
        if problem:
            problems.append(f"{shard['file']}: {problem}")
            continue
        reader = FileReader(path)
        try:
            count = reader.len()
            first = next(reader.get_next())["input_ids"]
        finally:
            reader.close()
        if count != shard["samples"]:
            problems.append(f"{shard['file']} holds {count} samples, {MANIFEST} says {shard['samples']}")
        if len(first) != manifest["sample_length"]:
            problems.append(f"{shard['file']}: samples of {len(first)} tokens, {MANIFEST} says "
                            f"{manifest['sample_length']}")
    if sum(s["samples"] for s in manifest["shards"]) != manifest["samples"]:
        problems.append(f"shard sample counts add up to {sum(s['samples'] for s in manifest['shards'])}, "
                        f"{MANIFEST} says {manifest['samples']}")
    tokenizer = os.path.join(dataset_dir, manifest["tokenizer"].get("file", "tokenizer.model"))
    if "sha256" not in manifest["tokenizer"]:  # token ids imported without a tokenizer (--from-megatron-indexed)
        pass
    elif not os.path.isfile(tokenizer):
        problems.append(f"{os.path.basename(tokenizer)} is missing")
    elif file_sha256(tokenizer) != manifest["tokenizer"]["sha256"]:
        problems.append(f"{os.path.basename(tokenizer)} does not match the tokenizer sha256 in {MANIFEST}")
    return problems


def show_sample(dataset_dir: str, index: int) -> str:
    """Decode packed sample `index` back to text, marking document boundaries and padding."""
    manifest = read_manifest(dataset_dir)
    if not 0 <= index < manifest["samples"]:
        raise DataError(f"dataset {dataset_dir}: --sample {index} is out of range (0..{manifest['samples'] - 1})")
    row, shard = index, None
    for shard in manifest["shards"]:
        if row < shard["samples"]:
            break
        row -= shard["samples"]
    problem = open_problem(os.path.join(dataset_dir, shard["file"]))
    if problem:
        raise DataError(f"dataset {dataset_dir}: {shard['file']}: {problem}",
                        hint=f"run python scripts/prepare_data.py --validate {dataset_dir}")
    reader = FileReader(os.path.join(dataset_dir, shard["file"]))
    try:
        for i, item in enumerate(reader.get_next()):
            if i == row:
                tokens = np.asarray(item["input_ids"], np.int32)
                break
    finally:
        reader.close()
    tok = manifest["tokenizer"]
    sp = load_tokenizer(os.path.join(dataset_dir, tok.get("file", "tokenizer.model")), special_ids=tok) \
        if "sha256" in tok else _IdsOnly()
    padding = int((tokens == tok["pad_id"]).sum())
    real = tokens[tokens != tok["pad_id"]].tolist()
    boundaries = real.count(tok["eod_id"])
    text, current = [], []
    for token in real:
        if token == tok["eod_id"]:
            text.append(sp.decode(current) + EOD_MARK)
            current = []
        else:
            current.append(token)
    text.append(sp.decode(current))
    stream = manifest.get("packing", {}).get("mode", "stream") == "stream"
    header = (f"sample {index} of {manifest['samples']} ({shard['file']} row {row}): {len(tokens)} tokens, "
              f"{boundaries} document end(s) marked <|EOD|>, {padding} padding")
    if stream and index:
        header += "; its first token repeats the previous sample's last (stream packing overlaps by one)"
    return header + "\n" + "-" * 80 + "\n" + "".join(text) + (f"\n<|PAD x {padding}|>" if padding else "")


class _IdsOnly:
    """Decoding for a dataset without a tokenizer (imported token ids): the ids themselves."""

    @staticmethod
    def decode(ids: list) -> str:
        return " ".join(map(str, ids))


def report_dataset(dataset_dir: str, output_dir: str = None) -> tuple:
    """(text report, PNG paths): filters and counts, tokens per source, document lengths, padding."""
    manifest = read_manifest(dataset_dir)
    output_dir = output_dir or os.path.join(dataset_dir, REPORT_DIR)
    os.makedirs(output_dir, exist_ok=True)
    sources = sorted(manifest.get("inputs", {}).get("list", []), key=lambda s: -s["tokens"])
    text = _report_text(dataset_dir, manifest, sources)
    with open(os.path.join(output_dir, REPORT_TEXT), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return text, _plots(dataset_dir, manifest, sources, output_dir)


def _report_text(dataset_dir: str, manifest: dict, sources: list) -> str:
    d = manifest["documents"]
    lines = [summary(dataset_dir, manifest), "", "documents:"]
    lines += [f"  {key:<16} {value:>12,}" for key, value in d.items() if key != "duplicate_ratio"]
    lines.append(f"  {'duplicate_ratio':<16} {d.get('duplicate_ratio', 0):>12.4%}")
    bad = manifest.get("bad_input", {})
    if any(bad.get("counts", {}).values()):
        lines += ["", "bad input (skipped):"]
        lines += [f"  {kind:<16} {n:>8,}   first: {bad['first'].get(kind, '')}"
                  for kind, n in bad["counts"].items() if n]
    skipped = manifest.get("inputs", {}).get("skipped", [])
    if skipped:
        lines += ["", f"not read ({len(skipped)} path(s) in the input folders):"]
        lines += [f"  {s['path']}: {s['reason']}" for s in skipped[:20]] + (["  ..."] if len(skipped) > 20 else [])
    packing = manifest.get("packing", {"mode": "stream", "tail": "pad", "split_documents": 0})
    lines += ["", f"packing: {packing['mode']} (tail {packing['tail']}), {manifest['samples']:,} samples, "
                  f"{manifest['padding_tokens']:,} padding tokens ({manifest['padding_rate']:.4%}), "
                  f"{manifest.get('dropped_tokens', 0):,} tail tokens dropped"
                  + (f", {packing['split_documents']:,} documents longer than a sample" if packing["mode"] != "stream"
                     else "")]
    if sources:
        lines += ["", f"tokens per source (top {min(20, len(sources))} of {len(sources)}):"]
        lines += [f"  {s['tokens']:>12,}  {s['documents']:>8,} docs  {s['path']}" for s in sources[:20]]
    histogram = manifest.get("doc_length_histogram")
    if histogram:
        lines += ["", "document length (tokens, EOD included):"]
        lines += [f"  {start:>9,}-{2 * start - 1:<9,} {count:>10,}"
                  for start, count in zip(histogram["bin_start_tokens"], histogram["documents"]) if count]
    return "\n".join(lines)


def _plots(dataset_dir: str, manifest: dict, sources: list, output_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name):
        path = os.path.join(output_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    histogram = manifest.get("doc_length_histogram")
    if histogram:
        fig, ax = plt.subplots(figsize=(8, 4))
        counts = histogram["documents"]
        last = max((i for i, c in enumerate(counts) if c), default=0) + 1
        ax.bar([f"{s:,}" for s in histogram["bin_start_tokens"][:last]], counts[:last])
        ax.set_xlabel("document length in tokens (bin start, powers of two)")
        ax.set_ylabel("documents")
        ax.set_title(f"{os.path.basename(dataset_dir.rstrip('/'))}: document lengths")
        ax.tick_params(axis="x", rotation=60)
        save(fig, "doc_lengths.png")
    if sources:
        top = sources[:25]
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(top) + 1.5))
        ax.barh([os.path.basename(s["path"]) for s in top][::-1], [s["tokens"] for s in top][::-1])
        ax.set_xlabel("tokens")
        ax.set_title(f"tokens per source (top {len(top)} of {len(sources)})")
        save(fig, "tokens_per_source.png")
    save(padding_figure(manifest), PADDING_PLOT)
    return paths


def padding_figure(manifest: dict):
    """Padding per shard (a bar per shard, integer shard ticks)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4))
    rates = [s.get("padding_tokens", 0) / (s["samples"] * manifest["sample_length"]) for s in manifest["shards"]]
    ax.bar(range(len(rates)), [100 * r for r in rates])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # shards are counted: no tick at 0.5
    ax.set_xlabel("shard")
    ax.set_ylabel("padding (% of tokens)")
    ax.set_title(f"padding: {manifest['padding_rate']:.4%} overall ({manifest.get('packing', {}).get('mode', 'stream')}"
                 " packing)")
    return fig
