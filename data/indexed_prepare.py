"""Pack Megatron indexed corpora (PREFIX.bin + .idx, data/indexed.py) into our MindRecord dataset, without
re-tokenizing: `prepare_data.py --from-megatron-indexed PREFIX [PREFIX ...] [--weights W ...]`.

The token stream is the text path's stream packing (data/packing.py StreamPacker, samples of
seq_length + 1 overlapping by one, as Megatron's GPTDataset builds them): documents in order
(the prefixes one after the other), each followed by one EOD id; a document that already ends
with it (preprocess_data.py --append-eod) gets no second one; empty documents are skipped.
Token ids >= the vocabulary are refused. --val-fraction holds documents out by a hash of their
tokens (as the text path hashes their text) into a validation dataset packed the same way.

--weights W1 .. Wn (Megatron's --data-path W1 P1 W2 P2 ...): weights of samples, hence of tokens,
not of documents. Each prefix is packed into its own stream (a sample never mixes two prefixes,
as in Megatron's BlendedDataset of GPTDatasets); the output holds as many samples as the prefixes
give together (one pass), interleaved so that every leading part of it holds prefix d in the
proportion w_d / sum(w): prefix d's k-th sample is placed at time (k + 0.5) / w_d and samples are
taken in time order (data/loader.py blend_order's rule; Megatron's greedy build_blending_indices
keeps the same proportions). A prefix drawn more often than it has samples is repeated (whole
passes, then evenly spaced samples of one more pass); one drawn less often contributes evenly
spaced samples. The manifest records each prefix's samples and draws.

The work is four steps, each a callable that datatrove's executors run as a pipeline step
(data/scale.py's executors; one task in this process when --tasks is 1):

    scan   (N tasks) documents in N ranges: check ids, find EODs, hash for the validation split
    plan   (1 task)  stream lengths -> samples, the blend order, shards per write task
    write  (N tasks) each task the shards assigned to it, built from the memmapped .bin files
    merge  (1 task)  the manifest(s), the validation dataset moved out, the dataset renamed into place

Every sample, and so every shard, is a function of the inputs alone: the dataset is byte-identical
whatever the number of tasks or the executor. Each task writes its result under a scratch name and
renames it when complete; a rerun with the same arguments redoes only what is missing.
"""

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.common.files import file_sha256, write_json_atomic
from ascend_llm_recipes.data.indexed import open_indexed
from ascend_llm_recipes.data.mindrecord_io import MANIFEST, partial_dir, shard_name, write_manifest, write_shard
from ascend_llm_recipes.data.packing import TAILS, StreamPacker
from ascend_llm_recipes.data.tokenizer import NO_PAD, load_tokenizer, resolve_tokenizer
from ascend_llm_recipes.models.arithmetic import ALIGN, round_up

SOURCE = "megatron_indexed"
STEPS = ("scan", "plan", "write", "merge")
SPLITS = ("train", "val")
SCAN_BLOCK = 1 << 24  # tokens a scan task reads at once (64 MB of int32)
_VOCAB_LIMIT = 1 << 31  # ids are stored as int32 in the MindRecord samples


@dataclass(frozen=True)
class IndexedOptions:
    """What shapes an indexed import; the CLI flag is in brackets."""

    prefixes: tuple                 # [--from-megatron-indexed]
    seq_length: int                 # [--seq-length]
    weights: tuple = ()             # [--weights] empty: the prefixes concatenated
    tokenizer: str = ""             # [--tokenizer] recorded in the dataset, gives the ids below
    vocab_size: int = 0             # [--vocab-size] without a tokenizer
    eod_id: int = -1                # [--eod-id] without a tokenizer, or to override its end-of-text id
    pad_id: int = NO_PAD            # [--pad-id] -1: no pad token (masked from the loss by the model)
    tail: str = "pad"               # [--tail]
    val_fraction: float = 0.0       # [--val-fraction]
    val_output: str = ""            # [--val-output] default OUTPUT-val
    samples_per_shard: int = 4096   # [--samples-per-shard]
    model_vocab_size: int = 0       # [--recipe]
    command: str = ""


class IndexedRun:
    """One import: its arguments checked, its scratch directory, and the four steps."""

    def __init__(self, output_dir: str, opts: IndexedOptions, tasks: int = 1):
        self.output_dir, self.opts, self.tasks = output_dir, opts, tasks
        self.work = partial_dir(output_dir)
        self.state = os.path.join(self.work, "state")
        self.scratch = os.path.join(self.state, "indexed")
        self.logs = os.path.abspath(output_dir.rstrip("/") + ".logs")
        self.val_output = opts.val_output or output_dir.rstrip("/") + "-val"
        self._check_arguments()
        self.corpora = [open_indexed(p) for p in opts.prefixes]
        self.tokenizer = self._tokenizer()
        self.fingerprint = self._fingerprint()

    def __getstate__(self) -> dict:
        """What a task is sent: the prefixes, not their per-document arrays (it reopens them)."""
        return {k: v for k, v in self.__dict__.items() if k != "corpora"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.corpora = [open_indexed(p) for p in self.opts.prefixes]

    # ---- arguments --------------------------------------------------------------------------

    def _check_arguments(self) -> None:
        o, problems = self.opts, []
        if o.seq_length <= 0 or o.seq_length % ALIGN:
            problems.append(f"--seq-length {o.seq_length} must be a positive multiple of {ALIGN} (e.g. "
                            f"{round_up(max(o.seq_length, 1), ALIGN)})")
        if o.weights and len(o.weights) != len(o.prefixes):
            problems.append(f"--weights has {len(o.weights)} value(s) for {len(o.prefixes)} prefix(es): give one "
                            "weight per --from-megatron-indexed prefix, in the same order")
        if any(not w > 0 for w in o.weights):
            problems.append(f"--weights {' '.join(map(str, o.weights))}: every weight must be > 0 (leave a prefix "
                            "out instead of weighting it 0)")
        if len(set(map(os.path.abspath, o.prefixes))) != len(o.prefixes):
            problems.append("a prefix is given twice: give it once (with --weights, a larger weight repeats it)")
        if o.tail not in TAILS:
            problems.append(f"--tail {o.tail!r}: use pad or drop")
        if not 0.0 <= o.val_fraction < 0.5:
            problems.append(f"--val-fraction {o.val_fraction}: must be in [0, 0.5)")
        if o.samples_per_shard < 1:
            problems.append(f"--samples-per-shard {o.samples_per_shard}: must be >= 1")
        if self.tasks < 1:
            problems.append(f"--tasks {self.tasks}: must be >= 1")
        if o.tokenizer:
            if o.vocab_size:
                problems.append("--vocab-size comes from --tokenizer: give one or the other")
        else:
            if not 0 < o.vocab_size < _VOCAB_LIMIT:
                problems.append("without --tokenizer, give the corpus's --vocab-size (and its --eod-id)")
            if o.eod_id < 0:
                problems.append("without --tokenizer, give the corpus's --eod-id (the end-of-document token id its "
                                "preprocess_data.py used, e.g. 2 for Llama 2, 50256 for GPT-2)")
        if problems:
            raise DataError("; ".join(problems), hint="fix the arguments; nothing was written")

    def _tokenizer(self) -> dict:
        """The manifest's tokenizer entry: from the user's tokenizer (with --eod-id/--pad-id overrides) or flags."""
        o = self.opts
        if o.tokenizer:
            path = resolve_tokenizer(o.tokenizer)
            overrides = {k: v for k, v in (("eod_id", o.eod_id), ("pad_id", o.pad_id)) if v != -1}
            tok = load_tokenizer(path, special_ids=overrides or None)
            entry = {"file": tok.file, "source": os.path.abspath(path), **tok.describe()}
            if "eod_id" in overrides:
                entry["eod_token"] = tok.engine.id_to_piece(tok.eod_id) if tok.kind == "sentencepiece" else \
                    tok.engine.id_to_token(tok.eod_id)
            self.tokenizer_path = path
        else:
            entry = {"kind": "", "source": "flags", "vocab_size": o.vocab_size, "unk_id": -1, "bos_id": -1,
                     "eod_id": o.eod_id, "eod_token": "", "pad_id": o.pad_id,
                     "padding": "its pad id" if o.pad_id != NO_PAD else
                     f"{NO_PAD}: no pad id given; the model masks these labels from the loss"}
            if o.vocab_size % ALIGN:
                entry["vocab_note"] = (f"{o.vocab_size} is not a multiple of {ALIGN}: the model pads its "
                                       "embedding and output tables (model.model_config.vocab_pad_multiple)")
            self.tokenizer_path = None
        vocab, problems = entry["vocab_size"], []
        if not 0 <= entry["eod_id"] < vocab:
            problems.append(f"end-of-document id {entry['eod_id']} is outside the vocabulary of {vocab}")
        if not (entry["pad_id"] == NO_PAD or 0 <= entry["pad_id"] < vocab):
            problems.append(f"--pad-id {entry['pad_id']} is outside the vocabulary of {vocab} (use -1 for none)")
        if entry["pad_id"] == entry["eod_id"]:
            problems.append(f"--pad-id {entry['pad_id']} is the end-of-document id: every document end would be "
                            "masked from the loss (use -1 for no pad id)")
        if o.model_vocab_size and vocab > o.model_vocab_size:
            problems.append(f"vocabulary of {vocab} does not fit model.model_config.vocab_size {o.model_vocab_size}")
        if problems:
            raise DataError("; ".join(problems), hint="fix --tokenizer/--vocab-size/--eod-id/--pad-id; nothing was "
                                                      "written")
        return entry

    def _fingerprint(self) -> str:
        files = [[os.path.abspath(c.prefix + s), os.path.getsize(c.prefix + s), os.stat(c.prefix + s).st_mtime_ns]
                 for c in self.corpora for s in (".idx", ".bin")]
        identity = {**self.identity(), "files": files,
                    "tokenizer_sha256": file_sha256(self.tokenizer_path) if self.tokenizer_path else None}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def identity(self) -> dict:
        o = self.opts
        return {"source": SOURCE, "prefixes": [os.path.abspath(p) for p in o.prefixes], "weights": list(o.weights),
                "seq_length": o.seq_length, "tokenizer": o.tokenizer or None,
                "vocab_size": self.tokenizer["vocab_size"], "eod_id": self.tokenizer["eod_id"],
                "pad_id": self.tokenizer["pad_id"], "tail": o.tail, "val_fraction": o.val_fraction,
                "samples_per_shard": o.samples_per_shard, "tasks": self.tasks}

    # ---- layout ----------------------------------------------------------------------------

    def path(self, *names) -> str:
        return os.path.join(self.scratch, *names)

    @property
    def streams(self) -> int:
        """Separate sample streams: one per prefix with --weights, else one for all."""
        return len(self.corpora) if self.opts.weights else 1

    def scan_ranges(self, rank: int) -> list:
        """Task `rank`'s [(corpus, first document, stop)]: contiguous ranges of about equal tokens."""
        counts = [c.documents for c in self.corpora]
        weights = np.concatenate([c.lengths + 1 for c in self.corpora]) if sum(counts) else np.zeros(0)
        bounds = np.searchsorted(np.cumsum(weights), np.arange(self.tasks + 1) * weights.sum() / self.tasks,
                                 side="left") if len(weights) else np.zeros(self.tasks + 1, np.int64)
        bounds[0], bounds[-1] = 0, sum(counts)
        start, stop, ranges, offset = int(bounds[rank]), int(bounds[rank + 1]), [], 0
        for i, count in enumerate(counts):
            a, b = max(start, offset) - offset, min(stop, offset + count) - offset
            if a < b:
                ranges.append((i, a, b))
            offset += count
        return ranges


# ---- step 1: scan -----------------------------------------------------------------------------------

def scan(run: IndexedRun, rank: int) -> None:
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


def _scan_results(run: IndexedRun) -> tuple:
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


def plan(run: IndexedRun, rank: int = 0) -> None:
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

    def __init__(self, run: IndexedRun, members: list, corpora: list, split: str):
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


def write(run: IndexedRun, rank: int) -> None:
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

def merge(run: IndexedRun, rank: int = 0) -> dict:
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
        if _ours(run, run.val_output):
            shutil.rmtree(run.val_output)
        os.rename(val_dir, run.val_output)
        common["validation"] = {"dataset_dir": os.path.relpath(run.val_output, run.output_dir), "documents": held,
                                "samples": val_manifest["samples"], "tokens": val_manifest["tokens"]}
    train_entry = _split_entry(run, train, shards["train"], drawn_tokens["train"])
    return write_manifest(run.work, {**common, "split": "train", **train_entry})


def _split_entry(run: IndexedRun, info: dict, shards: list, drawn_tokens: int) -> dict:
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


def _ours(run: IndexedRun, directory: str) -> bool:
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            return json.load(f).get("run_fingerprint") == run.fingerprint and os.path.isdir(run.work)
    except (OSError, json.JSONDecodeError):
        return False


# ---- running the steps ------------------------------------------------------------------------------

class Step:
    """One step as a datatrove pipeline step: datatrove calls it with (data, rank, world_size)."""

    def __init__(self, name: str, run: IndexedRun):
        self.name, self.run = name, run

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        {"scan": scan, "plan": plan, "write": write, "merge": merge}[self.name](self.run, rank)

    def __repr__(self) -> str:
        return f"indexed:{self.name}"


def step_tasks(run: IndexedRun, name: str) -> int:
    return run.tasks if name in ("scan", "write") else 1


def build_executors(run: IndexedRun, cluster) -> list:
    """One datatrove executor per step (data/scale.py's choices: local processes, Slurm jobs, Ray tasks)."""
    from ascend_llm_recipes.data.scale import stage_executor

    executors, previous = [], None
    for name in STEPS:
        previous = stage_executor([Step(name, run)], step_tasks(run, name), cluster, os.path.join(run.logs, name),
                                  f"indexed-{name}", previous)
        executors.append(previous)
    return executors


def prepare_indexed(output_dir: str, opts: IndexedOptions, executor: str = "local", tasks: int = 1,
                    cluster: dict = None, workers: int = -1):
    """Pack the prefixes into `output_dir`; returns the manifest (None when Slurm jobs were submitted).

    One task on the local executor runs the steps in this process; more tasks, or another executor,
    run them through datatrove (the `scale` extra), as data/scale.py does for text.
    """
    from ascend_llm_recipes.data.prepare import output_lock

    scaled = executor != "local" or tasks != 1
    options = None
    if scaled:
        from ascend_llm_recipes.data.scale import ClusterOptions
        options = ClusterOptions(executor=executor, tasks=tasks, workers=workers, **(cluster or {}))
        problems = options.problems()
        if problems:
            raise DataError("; ".join(problems), hint="fix the arguments; nothing was written")
    run = IndexedRun(output_dir, opts, tasks)
    with output_lock(output_dir):
        _check_outputs(run)
        manifest = _finished(run)
        if manifest is None:
            if options is not None and options.dry_run:
                raise DataError("--dry-run is not available with --from-megatron-indexed",
                                hint="submit the run (it is cheap to stop) or use --executor local")
            _open_work(run)
            try:
                manifest = _run_steps(run, options)
            except _Kept:
                raise
            except DataError:  # bad input found by a step: nothing is worth keeping
                shutil.rmtree(run.work, ignore_errors=True)
                shutil.rmtree(run.logs, ignore_errors=True)
                raise
            if manifest is None:
                return None
        shutil.rmtree(run.state, ignore_errors=True)
        shutil.rmtree(run.logs, ignore_errors=True)
        os.rename(run.work, run.output_dir)
    return manifest


def _run_steps(run: IndexedRun, options):
    if options is None:
        for name in STEPS[:-1]:
            for rank in range(step_tasks(run, name)):
                Step(name, run)(None, rank, step_tasks(run, name))
        return merge(run)
    if options.executor == "ray":
        import ray
        if not ray.is_initialized():
            from ascend_llm_recipes.data.scale import connect_ray
            connect_ray(options.address)
    executors = build_executors(run, options)
    if options.executor == "slurm":  # plan and merge run as one-task jobs there
        executors[-1].run()
        print(f"prepare: submitted {len(STEPS)} Slurm steps (last job id {executors[-1].job_id}); logs in "
              f"{run.logs}; rerun the same command when they are done to finish", file=sys.stderr)
        return None
    from ascend_llm_recipes.data.tasks import TaskPool, raise_failures

    # Local tasks run in data/tasks.py's watched processes, as the text path's do: a killed task stops the run
    # naming it instead of leaving datatrove's Pool waiting forever.
    most = max(step_tasks(run, name) for name in STEPS)
    pool = TaskPool(min(most, options.workers if options.workers > 0 else os.cpu_count() or 1)) \
        if options.executor == "local" else None
    try:
        for name, executor in zip(STEPS, executors):
            if step_tasks(run, name) == 1:  # in this process: a bad id becomes our one-line error, not a traceback
                Step(name, run)()
                continue
            failures = pool.run(executor, name) if pool else executor.run()
            left = executor.get_incomplete_ranks()
            if failures:
                raise_failures(name, failures, executor.world_size, executor.world_size - len(left), lambda e: e)
            if left:
                raise _Kept(f"step {name}: tasks {left} did not complete (logs: {executor.logging_dir.path}/logs)",
                            hint="rerun the same command: it redoes only the unfinished tasks")
    finally:
        if pool:
            pool.close()
    with open(os.path.join(run.work, MANIFEST), encoding="utf-8") as f:
        return json.load(f)


class _Kept(DataError):
    """A failure after which the completed tasks are kept for a rerun."""


def _check_outputs(run: IndexedRun) -> None:
    from ascend_llm_recipes.data.pipeline import check_outputs

    check_outputs(run.output_dir, run.val_output, lambda directory: _ours(run, directory))


def _finished(run: IndexedRun):
    try:
        with open(os.path.join(run.work, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("run_fingerprint") == run.fingerprint else None


def _open_work(run: IndexedRun) -> None:
    """Start OUTPUT.partial, or keep an interrupted identical run's completed steps."""
    record = os.path.join(run.state, "run.json")
    if os.path.isdir(run.work):
        try:
            with open(record, encoding="utf-8") as f:
                previous = json.load(f)
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous is not None and previous["fingerprint"] == run.fingerprint:
            return
        if previous is not None:
            changed = [f"{k} {previous['identity'].get(k)!r} -> {v!r}" for k, v in run.identity().items()
                       if previous["identity"].get(k) != v]
            raise DataError(f"{run.work} holds an interrupted run with other arguments or inputs (differs in: "
                            f"{', '.join(changed) or 'input files'})",
                            hint=f"rerun it with the same arguments to continue it, or delete {run.work} to start "
                                 "over with these")
        shutil.rmtree(run.work)
    shutil.rmtree(run.logs, ignore_errors=True)
    os.makedirs(run.scratch)
    write_json_atomic(record, {"fingerprint": run.fingerprint, "identity": run.identity()}, indent=2)


# ---- describing the result --------------------------------------------------------------------------

def indexed_summary(output_dir: str, manifest: dict) -> str:
    """One paragraph: what was read, packed and written."""
    d, tok = manifest["documents"], manifest["tokenizer"]
    prefixes = [i["path"] for i in manifest["inputs"]["list"]]
    text = (f"dataset {output_dir}: {d['kept']:,} documents of {len(prefixes)} Megatron indexed corpus(es) "
            f"({d['empty']} empty ones skipped; {d['ended_with_eod']:,} already ended with EOD id {tok['eod_id']}, "
            f"the others got one), {manifest['tokens']:,} tokens in {manifest['samples']:,} samples of "
            f"{manifest['sample_length']} tokens, {len(manifest['shards'])} shard(s), padding "
            f"{manifest['padding_rate']:.4%}, vocabulary {tok['vocab_size']}, pad id {tok['pad_id']}.")
    text += (f" Tokenizer: {tok['kind']} ({tok['source']})." if tok.get("kind") else
             " No tokenizer recorded (ids from --vocab-size/--eod-id/--pad-id): --show prints token ids.")
    for member in manifest.get("blend", []):
        text += (f" {member['prefix']}: weight {member['weight']:g} ({member['share']:.1%}), {member['drawn']:,} of "
                 f"its {member['samples']:,} samples drawn ({member['repeats']:.2f}x).")
    if manifest.get("validation"):
        v = manifest["validation"]
        text += (f" Validation: {v['documents']:,} documents held out, {v['tokens']:,} tokens in {v['samples']:,} "
                 f"samples in {os.path.normpath(os.path.join(output_dir, v['dataset_dir']))}.")
    return text


def indexed_command(manifest: dict, output_dir: str, seq_length: int = None, vocab_size: int = None) -> str:
    """The command that builds `manifest`'s (indexed) dataset again into `output_dir`."""
    import shlex

    args = manifest["arguments"]
    parts = ["python", "scripts/prepare_data.py", "--from-megatron-indexed", *args["prefixes"]]
    if args["weights"]:
        parts += ["--weights", *map(str, args["weights"])]
    parts += ["--output", output_dir, "--seq-length", str(seq_length or args["seq_length"])]
    if args["tokenizer"]:
        parts += ["--tokenizer", args["tokenizer"]]
    else:
        parts += ["--vocab-size", str(vocab_size or args["vocab_size"]), "--eod-id", str(args["eod_id"])]
    if args["pad_id"] != NO_PAD:
        parts += ["--pad-id", str(args["pad_id"])]
    defaults = IndexedOptions(prefixes=(), seq_length=0)
    for key, flag in (("tail", "--tail"), ("val_fraction", "--val-fraction"),
                      ("samples_per_shard", "--samples-per-shard")):
        if args[key] != getattr(defaults, key):
            parts += [flag, str(args[key])]
    return " ".join(shlex.quote(p) for p in parts)
