"""The steps of text preparation, each a small object the single-machine run (data/text/pipeline.py) and the tasks
of data/cluster/scale.py compose alike:

    Reader        inputs (a byte range of them) -> chunks of ~1 MB of raw text            (data/text/corpus.py)
    CleanTokenize chunks -> per document: status, digest, tokens + EOD, inline or in workers (data/text/workers.py)
    Account       counts by status, bad input with its file:line (--strict: the first stops) (data/report.py)
    Dedup         exact and near dedup in input order, the first copy kept                   (data/text/dedup.py)
    Verdicts      data/cluster/scale.py's stand-in for Dedup: the verdicts its `decide` stage took
    SplitPack     validation split by digest, packing, shard writing per Split               (data/packing.py,
                                                                                               data/mindrecord_io.py)
    TokenizerStep the dataset's tokenizer: the user's, or one trained on a TokenizerSample

Like datatrove's PipelineSteps, a step is called with (data, rank, world_size) and yields on what
it took (a `Batch` per chunk); `run_steps` drains a list of them, the one-task case of a datatrove
executor (the single-machine path does not import datatrove: it is the `scale` extra).
"""

import collections
import heapq
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ascend_llm_recipes.common.files import write_json_atomic
from ascend_llm_recipes.data.text.clean import KEPT
from ascend_llm_recipes.data.text.corpus import ChunkReader, Position
from ascend_llm_recipes.data.mindrecord_io import ShardWriter
from ascend_llm_recipes.data.packing import make_packer
from ascend_llm_recipes.data.report import LENGTH_BINS
from ascend_llm_recipes.data.tokenizer import FILES, SENTENCEPIECE, check_vocab_size, load_tokenizer, train_tokenizer
from ascend_llm_recipes.data.text.workers import init_pool_worker, init_worker, process_chunk

TOKENIZER = FILES[SENTENCEPIECE]  # a trained tokenizer's name in the dataset (a user's keeps its kind's name)
KEEP, DUPLICATE, NEAR_DUPLICATE = 0, 1, 2   # a dedup verdict per kept document


@dataclass
class Batch:
    """One chunk on its way through the steps."""

    chunk: object               # data.text.corpus.Chunk
    result: object              # data.text.workers.ChunkResult
    count: int                  # raw documents taken (max_documents may cut the last chunk)
    keep: np.ndarray = None     # over the chunk's KEPT documents: what dedup left
    written: int = 0            # shards this chunk completed
    mark: tuple = None          # the run's state before this chunk (data/text/pipeline.py's snapshots)


def run_steps(steps: list, rank: int = 0, world_size: int = 1) -> None:
    """Run steps as a datatrove executor runs one task's pipeline: each takes the iterator of the one before."""
    data = None
    for step in steps:
        data = step(data, rank, world_size)
    for _ in data or ():
        pass


class PerBatch:
    """A step that acts on each batch as it passes."""

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        for batch in data:
            self.apply(batch)
            yield batch

    def apply(self, batch: Batch) -> None:
        raise NotImplementedError


class Reader:
    """The job's inputs from `start` (up to `stop`) as chunks, in input order."""

    def __init__(self, job, start: Position = None, chunk_index: int = 0, stop: Position = None):
        self.job, self.start, self.chunk_index, self.stop = job, start or Position(), chunk_index, stop

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        reader = ChunkReader(self.job.files, self.job.opts.lines, self.job.opts.text_field)
        yield from reader.chunks(self.start, self.chunk_index, self.stop)


class CleanTokenize:
    """process_chunk over the chunks, in order: inline (workers 0), or in a pool with at most 2 chunks per worker
    queued (memory does not grow with the corpus). Without a tokenizer in `config`, it cleans and hashes only."""

    def __init__(self, config, workers: int):
        self.config, self.workers = config, workers

    def __call__(self, chunks, rank: int = 0, world_size: int = 1):
        for chunk, result in self._processed(chunks):
            yield Batch(chunk, result, len(result.status))

    def _processed(self, chunks):
        if not self.workers:
            init_worker(self.config)
            for chunk in chunks:
                yield chunk, process_chunk(chunk.pieces)
            return
        # spawn, not fork: this process may hold MindSpore's threads, which fork does not copy safely.
        with multiprocessing.get_context("spawn").Pool(self.workers, init_pool_worker, (self.config,)) as pool:
            queued = collections.deque()
            try:
                for chunk in chunks:
                    queued.append((chunk, pool.apply_async(process_chunk, (chunk.pieces,))))
                    if len(queued) > 2 * self.workers:
                        done, pending = queued.popleft()
                        yield done, pending.get()
                while queued:
                    done, pending = queued.popleft()
                    yield done, pending.get()
            except GeneratorExit:
                # The caller stopped early (a document quota): let the chunks in flight finish. The `with` would
                # otherwise terminate (SIGTERM) workers that may be writing a result, leaving the result queue's
                # lock held, and CPython's Pool.terminate then waits forever for its task handler (seen in the
                # suite: a fixture hung in Pool._terminate_pool with both workers killed).
                for _, pending in queued:
                    pending.wait()
            # Workers leave on their own (sentinels), so the `with`'s terminate has nobody left to kill.
            pool.close()
            pool.join()


class Progress:
    """Stops after the job's max_documents (cutting the last batch) and shows a progress bar over input bytes."""

    def __init__(self, job, tallies, desc: str, start: Position):
        self.job, self.tallies, self.desc, self.start = job, tallies, desc, start

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        job, documents = self.job, self.tallies.documents
        quota = job.max_documents - documents["read"] if job.max_documents else None
        progress = tqdm(total=sum(job.sizes), initial=sum(job.sizes[:self.start.file]), unit="B", unit_scale=True,
                        unit_divisor=1024, desc=self.desc, disable=not job.show_progress, mininterval=0.5)
        began, docs_at_start, tokens = time.perf_counter(), documents["kept"], 0
        try:
            for batch in data:
                batch.count = batch.count if quota is None else min(batch.count, quota)
                yield batch
                progress.update(batch.chunk.disk_bytes)
                result = batch.result
                if result.lengths is not None:
                    tokens += int(result.lengths[:int((result.status[:batch.count] == KEPT).sum())].sum())
                elapsed = max(time.perf_counter() - began, 1e-9)
                docs = documents["kept"] - docs_at_start
                progress.set_postfix_str(f"{docs:,} docs ({docs / elapsed:,.0f}/s), {tokens / 1e6:,.1f}M tokens "
                                         f"({tokens / elapsed / 1e6:,.2f}M/s)", refresh=False)
                if quota is not None:
                    quota -= batch.count
                    if quota <= 0:
                        return
        finally:
            progress.close()


class Account(PerBatch):
    """Bad input and length filters into the report; with `count_read`, the documents by status too (then every
    KEPT document starts as kept: `batch.keep`)."""

    def __init__(self, report, count_read: bool = True):
        self.report, self.count_read = report, count_read

    def apply(self, batch: Batch) -> None:
        self.report.record_bad(batch.chunk, batch.result, batch.count)
        self.report.record_filtered(batch.result, batch.count)
        if self.count_read:
            batch.keep = np.ones(self.report.count_read(batch.result, batch.count), bool)


def count_verdicts(tallies, batch: Batch, verdict: np.ndarray) -> None:
    """Apply dedup verdicts (one per KEPT document of the batch) to the batch and the counts."""
    tallies.documents["duplicates"] += int((verdict == DUPLICATE).sum())
    tallies.documents["near_duplicates"] += int((verdict == NEAR_DUPLICATE).sum())
    batch.keep = verdict == KEEP


class Dedup(PerBatch):
    """Exact dedup on `seen` (data/text/dedup.py KeyIndex) and, with `near`, near dedup; the first copy is kept."""

    def __init__(self, tallies, seen, near=None):
        self.tallies, self.seen, self.near = tallies, seen, near

    def apply(self, batch: Batch) -> None:
        result, count = batch.result, batch.count
        is_kept = result.status[:count] == KEPT
        verdict = self.judge(result.digest[:len(batch.keep)], result.file[:count][is_kept],
                             result.line[:count][is_kept], result.bands, result.shingle_counts, result.shingles)
        count_verdicts(self.tallies, batch, verdict)

    def judge(self, digests: np.ndarray, files: np.ndarray, lines: np.ndarray, bands, shingle_counts,
              shingles) -> np.ndarray:
        """The verdict on each document in order: bands, shingle_counts and the concatenated 5-gram sets are
        read with near dedup only."""
        verdict = np.full(len(digests), KEEP, np.uint8)
        fresh = set()
        for i, digest in enumerate(digests.tolist()):
            if digest in self.seen or digest in fresh:
                verdict[i] = DUPLICATE
            else:
                fresh.add(digest)
        self.seen.add_many(digests[verdict == KEEP])
        if self.near is not None:
            ends = np.cumsum(shingle_counts)
            for i in np.flatnonzero(verdict == KEEP):
                doc_shingles = shingles[ends[i] - shingle_counts[i]:ends[i]]
                if self.near.check(bands[i], doc_shingles, int(files[i]), int(lines[i]), int(digests[i])):
                    verdict[i] = NEAR_DUPLICATE
        return verdict


class Verdicts(PerBatch):
    """Dedup by verdicts taken earlier (data/cluster/scale.py's decide stage), consumed in order."""

    def __init__(self, tallies, verdicts: np.ndarray):
        self.tallies, self.verdicts, self.at = tallies, verdicts, 0

    def apply(self, batch: Batch) -> None:
        kept = len(batch.keep)
        count_verdicts(self.tallies, batch, self.verdicts[self.at:self.at + kept])
        self.at += kept


class Split:
    """One output dataset (train or validation): its packer and its shard writer."""

    def __init__(self, name: str, directory: str, job, pad_id: int, prefix: str = ""):
        self.name, self.directory, self.mode = name, directory, job.opts.packing
        os.makedirs(directory, exist_ok=True)
        self.packer = make_packer(job.opts.packing, job.seq_length, pad_id, job.opts.tail)
        self.writer = ShardWriter(directory, prefix or ("train" if name == "train" else "val"),
                                  job.samples_per_shard, pad_id)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> int:
        return self.writer.add(self.packer.add(tokens, lengths))

    def finish(self) -> None:
        self.writer.add(self.packer.finish())
        self.writer.finish()

    def mark(self) -> tuple:
        """What a snapshot needs of this split as it is now (references: packers never mutate arrays)."""
        meta, arrays = self.packer.state()
        return meta, arrays, self.writer.rows, list(self.writer.pending)


def make_splits(job, directory: str, pad_id: int, task: str = "") -> dict:
    """The train split in `directory` and, with --val-fraction, the validation split in directory/val; `task`
    names the shards of one of data/cluster/scale.py's tasks."""
    splits = {"train": Split("train", directory, job, pad_id, f"train{task}" if task else "")}
    if job.opts.val_fraction:
        splits["val"] = Split("val", os.path.join(directory, "val"), job, pad_id, f"val{task}" if task else "")
    return splits


class SplitPack(PerBatch):
    """Hold out the validation documents (by digest), pack the kept ones into their split and write its shards;
    counts the kept documents, their files and lengths."""

    def __init__(self, tallies, splits: dict, val_fraction: float):
        self.tallies, self.splits = tallies, splits
        self.val_below = int(val_fraction * (1 << 64))

    def apply(self, batch: Batch) -> None:
        result, count, keep, tallies = batch.result, batch.count, batch.keep, self.tallies
        d = tallies.documents
        is_kept = result.status[:count] == KEPT
        kept = len(keep)
        digests, lengths = result.digest[:kept], result.lengths[:kept]
        tokens = result.tokens[:int(lengths.sum())]
        held_out = keep & (digests < np.uint64(self.val_below)) if self.val_below else np.zeros(kept, bool)
        d["kept"] += int(keep.sum())
        d["validation"] += int(held_out.sum())
        files = result.file[:count][is_kept]
        np.add.at(tallies.file_docs, files[keep], 1)
        np.add.at(tallies.file_tokens, files[keep], lengths[keep])
        np.add.at(tallies.lengths, np.minimum(np.log2(lengths[keep]).astype(np.int64), LENGTH_BINS - 1), 1)
        for name, mask in (("train", keep & ~held_out), ("val", held_out)):
            if name in self.splits and mask.any():
                whole = mask.all()  # the common case: no copy
                batch.written += self.splits[name].add(tokens if whole else tokens[np.repeat(mask, lengths)],
                                                       lengths if whole else lengths[mask])

    def finish(self) -> None:
        for split in self.splits.values():
            split.finish()


class TokenizerSample:
    """The tokenizer's training sample: distinct documents with the smallest digests, up to a character budget."""

    def __init__(self, budget: int):
        self.budget, self.heap, self.digests, self.chars = budget, [], set(), 0

    def offer(self, order: int, digest: int, text: str) -> None:
        """Consider one kept document; `order` is its place among the kept documents in corpus order."""
        if digest in self.digests:
            return
        heapq.heappush(self.heap, (-digest, order, text))
        self.digests.add(digest)
        self.chars += len(text)
        while self.chars > self.budget and len(self.heap) > 1:
            neg, _, dropped = heapq.heappop(self.heap)
            self.digests.discard(-neg)
            self.chars -= len(dropped)

    def documents(self) -> list:
        """The sample in corpus order."""
        return [text for _, _, text in sorted(self.heap, key=lambda item: item[1])]


def sample_below(job) -> int:
    """Digests below this are sample candidates (4x the budget's share of the input: headroom for compressed
    inputs and filtered documents); below the budget every document is one."""
    budget, total = job.opts.tokenizer_sample_chars, max(1, sum(job.sizes))
    return 1 << 64 if 4 * budget >= total else int((1 << 64) * 4 * budget / total)


def train_on(job, docs: list, prefix: str, destination: str) -> dict:
    """Train the job's tokenizer on `docs` into `destination`; returns what it was trained on."""
    shutil.move(train_tokenizer(docs, job.vocab_size, prefix, corpus=job.corpus()), destination)
    return {"documents": len(docs), "chars": sum(len(d) for d in docs)}


class TokenizerStep:
    """The dataset's tokenizer, copied into OUTPUT.partial: the user's, or one trained once and recorded in the
    state (state/tokenizer.json: what it was trained on)."""

    def __init__(self, state):
        self.job, self.work = state.job, state.work
        self.path, self.record = os.path.join(state.work, TOKENIZER), os.path.join(state.state, "tokenizer.json")
        self.prefix = os.path.join(state.state, "tokenizer")

    def load(self, sample=None) -> tuple:
        """(the tokenizer, loaded from its copy inside the dataset; what it was trained on, or None). Trains one
        on `sample()` -> (documents, Report) unless given or done. A user's tokenizer keeps the special ids read
        from its source (an HF directory's tokenizer_config.json is not copied)."""
        source = self.job.tokenizer_source
        if source:
            tok = load_tokenizer(source)  # messages name the user's file, not the work copy
            check_vocab_size(source, tok.vocab_size, self.job.opts.model_vocab_size, "model.model_config.vocab_size")
            path = os.path.join(self.work, tok.file)
            if not os.path.isfile(path):
                shutil.copyfile(source, path + ".tmp")  # a half-copied model must not look complete
                os.replace(path + ".tmp", path)
            tok.path = path
            return tok, None
        if os.path.isfile(self.record):
            with open(self.record, encoding="utf-8") as f:
                return load_tokenizer(self.path), json.load(f)
        docs, report = sample()
        if not docs:
            raise report.no_usable_document()
        trained_on = train_on(self.job, docs, self.prefix, self.path)
        write_json_atomic(self.record, trained_on, indent=2)
        return load_tokenizer(self.path), trained_on

    def install(self, model: str, trained_on: str) -> tuple:
        """Put a tokenizer trained elsewhere (data/cluster/scale.py's decide stage) in place with its record; loads
        it."""
        for source, destination in ((model, self.path), (trained_on, self.record)):
            shutil.copyfile(source, destination + ".tmp")
            os.replace(destination + ".tmp", destination)
        return self.load()
