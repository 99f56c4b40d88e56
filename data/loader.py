"""Training reads prepared datasets: one, or several blended by weight; each data-parallel rank its own part.

The order of samples is a pure function of (datasets, weights, seed, passes, shuffle), so
every rank computes the same global order without talking to the others:

- each pass over the data draws sum(dataset sizes) samples; dataset d's k-th draw happens
  at "time" (k + 0.5) / weight_d and draws are taken in time order, so every prefix of the
  order holds each dataset in proportion to its weight (a small dataset is cycled, a large
  one thinned);
- within a dataset, each cycle through it is a fresh permutation seeded by (seed, dataset,
  cycle) (or the stored order when shuffle is off);
- global batch b is positions [b*G, (b+1)*G) of that order (G = samples per optimizer step
  over all data-parallel ranks); data-parallel rank r reads the r-th slice of B = G / ranks
  positions. Slices are disjoint, together they are exactly the global batch, and a run
  with more or fewer ranks (same G) sees the same data per step.

So after `step` optimizer steps the run has consumed `step * G` samples of the
order, and `build_train_dataset(..., start_step=step)` continues from there
(as does MindFormers' resume, which skips `step` batches of the dataset): that number is all
a checkpoint needs to record about data.

A loss-spike rollback (training/worker/callbacks.py) removes the offending samples from the order:
`skips` are [start, end) ranges of positions in the order above, and the order training
reads is that order with those positions left out. The skips a run made are kept in
RUN_DIR/data_skips.json and in every checkpoint after them, so each later rebuild (a
resume, another rank) reads the same order.

Everything here takes plain inputs, a `LoaderSpec`: training builds it from the recipe
(training/recipe/loader_spec.py), including MindFormers' rule for which ranks read which
batch; no function here reads a recipe (tests/test_layering.py checks).
"""

import hashlib
import json

import os
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import DataError
from ascend_llm_recipes.data.mindrecord_io import read_manifest, shard_files, verify_cached

SKIPS_FILE = "data_skips.json"


@dataclass(frozen=True)
class LoaderSpec:
    """What one rank reads, in plain values."""

    sources: tuple          # (dataset_dir, weight, the key naming it in errors), in blend order
    seed: int
    passes: int             # passes over the data in the order (epochs x repeat)
    shuffle: bool
    batch: int              # samples per batch on this rank
    dp_rank: int = 0        # this rank's slice of every global batch ...
    dp_size: int = 1        # ... of dp_size slices (1: every rank reads the whole global batch)
    skips: tuple = ()       # [start, end) ranges of the order a loss-spike rollback removed
    seq_length: int = 0     # tokens per sample - 1 (the shape of a simulated dataset)
    num_parallel_workers: int = 1
    prefetch_size: int = 1
    numa_enable: bool = False

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every data-parallel rank."""
        return self.batch * self.dp_size


@dataclass(frozen=True)
class Source:
    dataset_dir: str
    weight: float
    samples: int
    files: tuple


def load_sources(entries) -> list:
    """[(dataset_dir, weight, key naming it)] -> Sources; blended datasets must share tokenizer and sample length."""
    sources, first = [], None
    for dataset_dir, weight, key in entries:
        try:
            manifest = read_manifest(dataset_dir)
        except DataError as err:
            raise DataError(f"{key}: {err.message}", hint="build it with scripts/prepare_data.py") from None
        if first is None:
            first = (key, manifest)
        else:
            first_key, ref = first
            for field, value, ref_value in (("tokenizer sha256", manifest["tokenizer"].get("sha256"),
                                             ref["tokenizer"].get("sha256")),
                                            ("sample length", manifest["sample_length"], ref["sample_length"])):
                if value != ref_value:
                    raise DataError(f"{key}: {dataset_dir} has another {field} than {first_key} ({value} vs "
                                    f"{ref_value}); blended datasets must share one tokenizer and seq_length",
                                    hint="prepare them with the same --tokenizer MODEL and --seq-length")
        if not manifest["samples"]:
            raise DataError(f"{key}: {dataset_dir} holds no samples", hint="prepare it from more text")
        files = tuple(shard_files(dataset_dir, manifest))
        sources.append(Source(dataset_dir, weight, manifest["samples"], files))
    return sources


def blend_order(sizes: list, weights: list, seed: int, passes: int, shuffle: bool) -> tuple:
    """(dataset index, sample index) arrays for `passes` passes of sum(sizes) samples each (see module doc)."""
    weights = np.asarray(weights, np.float64) / float(np.sum(weights))
    total = passes * int(sum(sizes))
    times, owner = [], []
    for d, w in enumerate(weights):
        draws = int(np.ceil(total * w)) + 1
        times.append((np.arange(draws) + 0.5) / w)
        owner.append(np.full(draws, d, np.int32))
    order = np.argsort(np.concatenate(times), kind="stable")[:total]  # ties: the earlier dataset first
    dataset = np.concatenate(owner)[order]
    sample = np.empty(total, np.int64)
    for d, size in enumerate(sizes):
        where = np.flatnonzero(dataset == d)
        if len(where):
            cycles = [_permutation(size, seed, d, c, shuffle) for c in range(-(-len(where) // size))]
            sample[where] = np.concatenate(cycles)[:len(where)]
    return dataset, sample


def _permutation(size: int, seed: int, dataset: int, cycle: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return np.random.default_rng([seed, dataset, cycle]).permutation(size).astype(np.int64)


def rank_positions(total: int, batch: int, dp_rank: int, dp_size: int, start_step: int = 0) -> np.ndarray:
    """This rank's positions in the global order: its slice of every global batch from `start_step` on."""
    global_batch = batch * dp_size
    steps = np.arange(start_step, total // global_batch, dtype=np.int64)
    return (steps[:, None] * global_batch + dp_rank * batch + np.arange(batch)[None, :]).reshape(-1)


def verify_datasets(dataset_dirs) -> list:
    """Verify the files of every dataset in `dataset_dirs` before training; one line each."""
    return [f"dataset {d}: {verify_cached(d, read_manifest(d))}" for d in dict.fromkeys(dataset_dirs)]


def training_order(spec: LoaderSpec) -> tuple:
    """(sources, flat sample ids in the order training reads them): the blend order minus `spec.skips`.

    A flat id indexes the sources' samples concatenated in blend order (dataset d's sample i
    is offsets[d] + i), which is how the shard files are listed to MindDataset.
    """
    sources = load_sources(spec.sources)
    dataset, sample = blend_order([s.samples for s in sources], [s.weight for s in sources], spec.seed, spec.passes,
                                  spec.shuffle)
    offsets = np.cumsum([0] + [s.samples for s in sources[:-1]])
    ids = offsets[dataset] + sample
    return sources, ids[kept_positions(len(ids), spec.skips)]


def kept_positions(total: int, skips=()) -> np.ndarray:
    """Positions of the blend order that remain after removing the [start, end) ranges in `skips`."""
    keep = np.ones(total, bool)
    for start, end in skips:
        keep[start:end] = False
    return np.flatnonzero(keep)


def skip_range(total: int, skips, first_step: int, last_step: int, global_batch_size: int) -> list:
    """The blend-order ranges steps first_step..last_step (1-based) read, given the skips already made."""
    positions = kept_positions(total, skips)[(first_step - 1) * global_batch_size:last_step * global_batch_size]
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(positions, breaks) if len(run)]


def next_samples_count(global_batch_size: int) -> int:
    """How many upcoming sample ids a checkpoint records: one global batch, at most 1024."""
    return min(global_batch_size, 1024)


def next_samples(spec: LoaderSpec, position: int, count: int = None) -> dict:
    """What a checkpoint records to verify its data position: the next `count` sample ids and their hash.

    `count` defaults to next_samples_count. On resume the same function runs on the resumed
    recipe's spec: a different seed, shuffle, blend, dataset or skip list gives other ids.
    """
    return describe_next(training_order(spec)[1], position, count or next_samples_count(spec.global_batch))


def describe_next(ids: np.ndarray, position: int, count: int) -> dict:
    """{position, count, first_ids, sha256} of ids[position:position + count] (see next_samples)."""
    upcoming = np.ascontiguousarray(ids[position:position + count], dtype=np.int64)
    return {"position": int(position), "count": int(len(upcoming)), "first_ids": upcoming[:8].tolist(),
            "sha256": hashlib.sha256(upcoming.tobytes()).hexdigest()}


def read_skips(run_dir: str) -> list:
    """The rollbacks a run made (RUN_DIR/data_skips.json), oldest first; [] when none."""
    try:
        with open(os.path.join(run_dir, SKIPS_FILE), encoding="utf-8") as f:
            return json.load(f)["rollbacks"]
    except FileNotFoundError:
        return []


def skip_ranges(rollbacks: list) -> list:
    """Every [start, end) blend-order range the rollbacks removed."""
    return [tuple(r) for rollback in rollbacks for r in rollback["skipped_positions"]]


def rank_samples(spec: LoaderSpec, start_step: int = 0) -> tuple:
    """(sources, flat sample indices this rank reads in order, batch size): everything but the MindSpore dataset."""
    sources, ids = training_order(spec)
    positions = rank_positions(len(ids), spec.batch, spec.dp_rank, spec.dp_size, start_step)
    if not len(positions):
        raise DataError(f"train_dataset: {len(ids)} samples ({spec.passes} pass(es)) hold no global batch of "
                        f"{spec.global_batch} samples after step {start_step}",
                        hint="use more data, more runner_config.epochs, or a smaller runner_config.batch_size")
    return sources, ids[positions], spec.batch


def simulated_train_dataset(spec: LoaderSpec, steps: int):
    """Batches of zeros of the training data's shape, for MindSpore's DryRun (MS_SIMULATION_LEVEL).

    A simulated compile computes no values (mindspore/utils/dryrun.py:37-57), so it needs the shapes
    only: the recipe's placeholder dataset does not have to exist on the machine that compiles.
    """
    import mindspore.dataset as ds

    rows = np.zeros((steps * spec.batch, spec.seq_length + 1), np.int32)
    return ds.NumpySlicesDataset({"input_ids": rows}, shuffle=False).batch(spec.batch, drop_remainder=True)


def build_train_dataset(spec: LoaderSpec, start_step: int = 0):
    """The MindSpore dataset a rank trains on from `start_step`: batches of (batch, seq_length + 1) int32 input_ids."""
    import mindspore.dataset as ds

    # As MindFormers' own dataset builder does. It matters beyond data: it also seeds Python's
    # and NumPy's global generators, which the model's initial weights are drawn from next.
    ds.config.set_seed(spec.seed)
    ds.config.set_prefetch_size(spec.prefetch_size)
    ds.config.set_numa_enable(spec.numa_enable)
    sources, indices, batch = rank_samples(spec, start_step)
    files = [f for s in sources for f in s.files]
    # MindRecord refuses a subset longer than the data it samples, so several passes
    # (epochs x repeat) read as consecutive segments of at most that length.
    rows = sum(s.samples for s in sources)
    segments = [ds.MindDataset(files, columns_list=["input_ids"], sampler=ds.SubsetSampler(part.tolist()),
                               num_parallel_workers=spec.num_parallel_workers)
                for part in np.split(indices, range(rows, len(indices), rows))]
    data = segments[0].concat(segments[1:]) if len(segments) > 1 else segments[0]
    return data.batch(batch, drop_remainder=True)
