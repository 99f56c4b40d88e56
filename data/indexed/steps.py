"""The four steps of an indexed import (data/indexed/prepare.py runs them, through datatrove's executors or in
this process): scan, plan, write and merge, each a function of (run, rank) writing its result under a
scratch name and renaming it when complete.
"""

import hashlib
import json
import os
import shutil

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import write_json_atomic
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, shard_name, write_manifest, write_shard
from ascend_llm_recipes.data.packing import StreamPacker

SOURCE = "megatron_indexed"
SPLITS = ("train", "val")
SCAN_BLOCK = 1 << 24  # tokens a scan task reads at once (64 MB of int32)


# ---- step 1: scan -----------------------------------------------------------------------------------

def scan(run, rank: int) -> None:
    """Per document of this task's ranges: its packed length (tokens + EOD unless present, 0 when empty) and
    whether it is held out; a problem (an id outside the vocabulary) is recorded for the driver to report."""
    final = run.path("scan", f"{rank:05d}.npz")
    if os.path.isfile(final):
        return
    os.makedirs(run.path("scan"), exist_ok=True)
    vocab, eod = run.tokenizer["vocab_size"], run.tokenizer["eod_id"]
    val_below = int(run.opts.val_fraction * (1 << 64))
    arrays, counts, problem = {}, {"documents": 0, "empty": 0, "ended_with_eod": 0, "tokens": 0}, None
    for corpus_index, first, stop in run.scan_ranges(rank):
        corpus = run.corpora[corpus_index]
        tokens = corpus.tokens_memmap()
        starts, lengths = corpus.starts[first:stop], corpus.lengths[first:stop]
        packed = np.zeros(len(lengths), np.int64)
        held = np.zeros(len(lengths), bool)
        ends = starts + lengths
        i = 0
        while i < len(lengths):  # blocks of whole documents, ~SCAN_BLOCK tokens each (documents are back to back)
            j = max(i + 1, int(np.searchsorted(ends, starts[i] + SCAN_BLOCK, side="right")))
            block = np.asarray(tokens[int(starts[i]):int(ends[j - 1])])
            docs = np.flatnonzero(lengths[i:j] > 0) + i
            if len(docs):
                offsets = starts[docs] - starts[i]
                low, high = np.minimum.reduceat(block, offsets), np.maximum.reduceat(block, offsets)
                outside = np.flatnonzero((low.astype(np.int64) < 0) | (high.astype(np.int64) >= vocab))
                if len(outside) and problem is None:
                    k = outside[0]
                    bad = int(low[k]) if low[k] < 0 else int(high[k])
                    given = f"--tokenizer {run.opts.tokenizer}" if run.opts.tokenizer else "--vocab-size"
                    problem = (f"{corpus.bin_path}: document {first + int(docs[k])} holds token id {bad}, outside "
                               f"the vocabulary of {vocab} ({given})")
                ended = block[offsets + lengths[docs] - 1].astype(np.int64) == eod
                packed[docs] = lengths[docs] + ~ended
                counts["ended_with_eod"] += int(ended.sum())
                if val_below:
                    for k, offset, length in zip(docs.tolist(), offsets.tolist(), lengths[docs].tolist()):
                        doc = np.ascontiguousarray(block[offset:offset + length], np.int32)
                        digest = hashlib.blake2b(doc.tobytes(), digest_size=8).digest()
                        held[k] = int.from_bytes(digest, "little") < val_below
            i = j
        counts["documents"] += len(lengths)
        counts["empty"] += int((lengths == 0).sum())
        counts["tokens"] += int(lengths.sum())
        arrays[f"packed_{corpus_index}"], arrays[f"held_{corpus_index}"] = packed, held
        del tokens
    arrays["meta"] = np.frombuffer(json.dumps({"counts": counts, "problem": problem,
                                               "ranges": run.scan_ranges(rank)}).encode(), np.uint8)
    with open(final + ".tmp", "wb") as f:
        np.savez(f, **arrays)
    os.replace(final + ".tmp", final)


def _scan_results(run) -> tuple:
    """(per corpus: packed lengths and held-out masks over all its documents, summed counts, first problem)."""
    packed = [[] for _ in run.corpora]
    held = [[] for _ in run.corpora]
    counts, problem = {}, None
    for rank in range(run.tasks):
        with np.load(run.path("scan", f"{rank:05d}.npz")) as npz:
            meta = json.loads(npz["meta"].tobytes())
            for corpus_index, _, _ in meta["ranges"]:
                packed[corpus_index].append(npz[f"packed_{corpus_index}"])
                held[corpus_index].append(npz[f"held_{corpus_index}"])
        for key, value in meta["counts"].items():
            counts[key] = counts.get(key, 0) + value
        problem = problem or meta["problem"]
    join = [(np.concatenate(p) if p else np.zeros(0, np.int64), np.concatenate(h) if h else np.zeros(0, bool))
            for p, h in zip(packed, held)]
    return join, counts, problem


# ---- step 2: plan -----------------------------------------------------------------------------------

def stream_samples(tokens: int, seq_length: int, tail: str) -> tuple:
    """(samples, padding tokens, dropped tokens) StreamPacker makes of a stream of `tokens` tokens."""
    full = (tokens - 1) // seq_length if tokens > seq_length else 0
    left = tokens - full * seq_length
    if left <= 1:
        return full, 0, 0
    if tail == "pad":
        return full + 1, seq_length + 1 - left, 0
    return full, 0, left - 1


def blend_draws(samples: list, weights: list) -> tuple:
    """(stream index, sample index) of each output sample: sum(samples) draws interleaved by weight (module doc)."""
    total = int(sum(samples))
    w = np.asarray(weights, np.float64) / float(np.sum(weights))
    times, owner = [], []
    for d, weight in enumerate(w):
        draws = int(np.ceil(total * weight)) + 1
        times.append((np.arange(draws) + 0.5) / weight)
        owner.append(np.full(draws, d, np.int32))
    order = np.argsort(np.concatenate(times), kind="stable")[:total]
    stream = np.concatenate(owner)[order] if total else np.zeros(0, np.int32)
    sample = np.zeros(total, np.int64)
    for d, count in enumerate(samples):
        where = np.flatnonzero(stream == d)
        sample[where] = spread(len(where), count)
    return stream, sample


def spread(draws: int, count: int) -> np.ndarray:
    """Sample indices for `draws` draws from `count` samples: whole passes in order, then evenly spaced ones."""
    if not draws:
        return np.zeros(0, np.int64)
    passes, left = divmod(draws, count)
    rest = np.arange(left, dtype=np.int64) * count // left if left else np.zeros(0, np.int64)
    return np.concatenate([np.tile(np.arange(count, dtype=np.int64), passes), rest])


def plan(run, rank: int = 0) -> None:
    """Stream lengths and sample counts per split and stream, the blend order, and the shards of each write task."""
    final = run.path("plan.json")
    if os.path.isfile(final):
        return
    corpora, counts, problem = _scan_results(run)
    if problem:
        raise DataError(problem, hint="pass the tokenizer (or --vocab-size) the corpus was tokenized with; nothing "
                                      "was written")
    splits = {}
    for split in SPLITS if run.opts.val_fraction else SPLITS[:1]:
        streams = []
        for s in range(run.streams):
            members = range(len(run.corpora)) if not run.opts.weights else [s]
            tokens = sum(int(corpora[c][0][(corpora[c][1] if split == "val" else ~corpora[c][1])].sum())
                         for c in members)
            documents = sum(int(((corpora[c][0] > 0) & (corpora[c][1] if split == "val" else ~corpora[c][1])).sum())
                            for c in members)
            samples, padding, dropped = stream_samples(tokens, run.opts.seq_length, run.opts.tail)
            streams.append({"tokens": tokens, "documents": documents, "samples": samples, "padding_tokens": padding,
                            "dropped_tokens": dropped})
        if split == "train" and run.opts.weights:
            empty = [run.opts.prefixes[s] for s, st in enumerate(streams) if not st["samples"]]
            if empty:
                raise DataError(f"{', '.join(empty)}: no full sample of {run.opts.seq_length + 1} tokens to draw from",
                                hint="leave such prefixes out of --weights, or lower --seq-length; nothing was "
                                     "written")
        used = [s for s, st in enumerate(streams) if st["samples"]]
        weights = [run.opts.weights[s] for s in used] if run.opts.weights else [1.0] * len(used)
        stream, sample = blend_draws([streams[s]["samples"] for s in used], weights)
        stream = np.asarray(used, np.int32)[stream] if len(used) else stream
        np.save(run.path(f"{split}.stream.npy"), stream.astype(np.int32))
        np.save(run.path(f"{split}.sample.npy"), sample)
        for s, st in enumerate(streams):
            st["drawn"] = int((stream == s).sum())
        shards = -(-len(stream) // run.opts.samples_per_shard)
        splits[split] = {"streams": streams, "samples": int(len(stream)), "shards": shards,
                         "write": [[shards * t // run.tasks, shards * (t + 1) // run.tasks] for t in range(run.tasks)]}
    if not splits["train"]["samples"]:
        raise DataError(f"{' '.join(run.opts.prefixes)}: {counts.get('tokens', 0)} tokens in "
                        f"{counts.get('documents', 0)} documents make no sample of {run.opts.seq_length + 1} tokens",
                        hint="lower --seq-length or give more data; nothing was written")
    write_json_atomic(final, {"counts": counts, "splits": splits}, indent=2)


# ---- step 3: write ----------------------------------------------------------------------------------

class StreamReader:
    """Token ranges of one split's stream of documents (EOD appended where missing) read from the memmaps."""

    def __init__(self, run, members: list, corpora: list, split: str):
        self.parts = []  # (corpus, document indices in the split, their stream offsets)
        offset = 0
        for c in members:
            packed, held = corpora[c]
            chosen = np.flatnonzero((packed > 0) & (held if split == "val" else ~held))
            starts = offset + np.concatenate([[0], np.cumsum(packed[chosen])])
            self.parts.append((run.corpora[c], run.corpora[c].tokens_memmap(), chosen, starts, packed))
            offset = int(starts[-1])
        self.eod = run.tokenizer["eod_id"]
        self.length = offset

    def read(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens [start, stop): the documents overlapping it gathered from the memmap (only their pages
        are read), EODs inserted where their packed length says."""
        out = []
        for corpus, tokens, chosen, starts, packed in self.parts:
            if stop <= starts[0] or start >= starts[-1]:
                continue
            k0 = max(int(np.searchsorted(starts, start, side="right")) - 1, 0)
            k1 = int(np.searchsorted(starts, stop, side="left"))
            docs = chosen[k0:k1]
            lengths = corpus.lengths[docs]
            within = np.cumsum(lengths) - lengths  # each document's first position among the gathered tokens
            where = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(corpus.starts[docs] - within, lengths)
            body = np.asarray(tokens[where], np.int32)
            needs = packed[docs] > lengths
            body = np.insert(body, (within + lengths)[needs], np.int32(self.eod))
            base = int(starts[k0])
            out.append(body[max(start - base, 0):stop - base])
        return np.concatenate(out) if out else np.zeros(0, np.int32)


def sample_rows(reader: StreamReader, indices: np.ndarray, seq_length: int, pad_id: int, tail: str) -> dict:
    """{sample index: row} for the requested samples of one stream, each run of consecutive samples packed by a
    StreamPacker fed from that run's first token (so the rows are exactly the whole stream's)."""
    rows = {}
    wanted = np.unique(indices)
    if not len(wanted):
        return rows
    breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
    for run_ in np.split(wanted, breaks):
        first, last = int(run_[0]), int(run_[-1])
        stop = min((last + 1) * seq_length + 1, reader.length)
        packer = StreamPacker(seq_length, pad_id, tail)
        tokens = reader.read(first * seq_length, stop)
        got = packer.add(tokens, np.array([len(tokens)]))
        if stop == reader.length:
            got = np.concatenate([got, packer.finish()])
        for i, row in enumerate(got[:last - first + 1]):
            rows[first + i] = row
    return rows


def write(run, rank: int) -> None:
    """The shards the plan gave this task, for every split."""
    final = run.path("write", f"{rank:05d}.json")
    if os.path.isfile(final):
        return
    os.makedirs(run.path("write"), exist_ok=True)
    with open(run.path("plan.json"), encoding="utf-8") as f:
        planned = json.load(f)
    corpora, _, _ = _scan_results(run)
    pad, per_shard = run.tokenizer["pad_id"], run.opts.samples_per_shard
    record = {}
    for split, info in planned["splits"].items():
        directory = run.work if split == "train" else os.path.join(run.work, "val")
        os.makedirs(directory, exist_ok=True)
        streams = np.load(run.path(f"{split}.stream.npy"), mmap_mode="r")
        samples = np.load(run.path(f"{split}.sample.npy"), mmap_mode="r")
        readers = {}
        entries, tokens = [], 0
        first_shard, stop_shard = info["write"][rank]
        for shard in range(first_shard, stop_shard):
            lo, hi = shard * per_shard, min((shard + 1) * per_shard, info["samples"])
            which, index = np.asarray(streams[lo:hi]), np.asarray(samples[lo:hi])
            block = np.zeros((hi - lo, run.opts.seq_length + 1), np.int32)
            for s in np.unique(which).tolist():
                if s not in readers:
                    members = [s] if run.opts.weights else list(range(len(run.corpora)))
                    readers[s] = StreamReader(run, members, corpora, split)
                mask = which == s
                rows = sample_rows(readers[s], index[mask], run.opts.seq_length, pad, run.opts.tail)
                block[mask] = np.stack([rows[int(i)] for i in index[mask]])
            entries.append(write_shard(directory, shard_name(split, shard), block, pad))
            # Tokens the samples hold, each counted once per draw: a stream's samples overlap by one token.
            tokens += int(block.size - entries[-1]["padding_tokens"] - np.count_nonzero(index))
        record[split] = {"shards": entries, "tokens": tokens}
    write_json_atomic(final, record)


# ---- step 4: merge ----------------------------------------------------------------------------------

def merge(run, rank: int = 0) -> dict:
    """The manifest(s) from the plan and the tasks' shards; the validation dataset moved to its place."""
    manifest_path = os.path.join(run.work, MANIFEST)
    if os.path.isfile(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            return json.load(f)
    with open(run.path("plan.json"), encoding="utf-8") as f:
        planned = json.load(f)
    shards = {split: [] for split in planned["splits"]}
    drawn_tokens = dict.fromkeys(planned["splits"], 0)
    for task in range(run.tasks):
        with open(run.path("write", f"{task:05d}.json"), encoding="utf-8") as f:
            for split, done in json.load(f).items():
                shards[split] += done["shards"]
                drawn_tokens[split] += done["tokens"]
    tokenizer = dict(run.tokenizer)
    if run.tokenizer_path:
        target = os.path.join(run.work, tokenizer["file"])
        shutil.copyfile(run.tokenizer_path, target + ".tmp")
        os.replace(target + ".tmp", target)
    counts = planned["counts"]
    inputs = []
    for corpus in run.corpora:
        inputs.append({"path": os.path.abspath(corpus.prefix), "format": f"megatron_indexed ({corpus.dtype.name})",
                       "bytes": os.path.getsize(corpus.bin_path) + os.path.getsize(corpus.prefix + ".idx"),
                       "documents": corpus.documents, "tokens": corpus.tokens})
    train = planned["splits"]["train"]
    val = planned["splits"].get("val")
    held = sum(s["documents"] for s in val["streams"]) if val else 0
    kept = counts["documents"] - counts["empty"]
    documents = {"read": counts["documents"], "kept": kept, "empty": counts["empty"],
                 "ended_with_eod": counts["ended_with_eod"], "duplicates": 0, "invalid_utf8": 0, "too_short": 0,
                 "validation": held, "train": kept - held, "duplicate_ratio": 0.0}
    common = {"source": SOURCE, "command": run.opts.command, "arguments": run.identity(),
              "run_fingerprint": run.fingerprint,
              "inputs": {"files": len(inputs), "bytes": sum(i["bytes"] for i in inputs), "missing": [],
                         "list": inputs},
              "options": {"packing": "stream", "tail": run.opts.tail, "val_fraction": run.opts.val_fraction,
                          "eod": "one after each document, unless its last token is already the EOD id"},
              "documents": documents, "bad_input": {"counts": {}, "first": {}}, "tokenizer": tokenizer,
              "seq_length": run.opts.seq_length, "sample_length": run.opts.seq_length + 1,
              "tasks": {"count": run.tasks}}
    if val:
        val_dir = os.path.join(run.work, "val")
        if run.tokenizer_path:
            shutil.copyfile(run.tokenizer_path, os.path.join(val_dir, tokenizer["file"]))
        val_entry = _split_entry(run, val, shards["val"], drawn_tokens["val"])
        val_manifest = write_manifest(val_dir, {**common, "split": "validation", **val_entry})
        if run.outputs.ours(run.val_output):
            shutil.rmtree(run.val_output)
        os.rename(val_dir, run.val_output)
        common["validation"] = {"dataset_dir": os.path.relpath(run.val_output, run.output_dir), "documents": held,
                                "samples": val_manifest["samples"], "tokens": val_manifest["tokens"]}
    train_entry = _split_entry(run, train, shards["train"], drawn_tokens["train"])
    return write_manifest(run.work, {**common, "split": "train", **train_entry})


def _split_entry(run, info: dict, shards: list, drawn_tokens: int) -> dict:
    """A split's packing figures; with --weights, tokens are those of the drawn samples (a repeat counts again)."""
    streams = info["streams"]
    padding = sum(s["padding_tokens"] for s in shards)
    slots = info["samples"] * (run.opts.seq_length + 1)
    entry = {"packing": {"mode": "stream", "tail": run.opts.tail, "split_documents": 0}, "samples": info["samples"],
             "tokens": drawn_tokens if run.opts.weights else sum(s["tokens"] for s in streams),
             "padding_tokens": padding, "padding_rate": round(padding / slots, 8) if slots else 0.0,
             "dropped_tokens": sum(s["dropped_tokens"] for s in streams), "shards": shards}
    if run.opts.weights:
        total = sum(run.opts.weights)
        entry["blend"] = [{"prefix": os.path.abspath(p), "weight": w, "share": round(w / total, 6),
                           "samples": s["samples"], "drawn": s["drawn"],
                           "repeats": round(s["drawn"] / s["samples"], 4) if s["samples"] else 0.0,
                           "documents": s["documents"], "tokens": s["tokens"]}
                          for p, w, s in zip(run.opts.prefixes, run.opts.weights, streams)]
        entry["blend_rule"] = ("samples (so tokens) by weight, one pass of sum(samples) draws; prefix d's k-th "
                               "sample at time (k + 0.5) / w_d")
    return entry
