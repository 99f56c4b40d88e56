"""Megatron-LM checkpoint files: legacy mp_rank_TT[_PPP]/model_optim_rng.pt and torch_dist directories.

The readers present each Megatron tensor (a key of tables.MEGATRON_TENSORS, generated from
MEGATRON_TABLE's rows), one tensor-parallel shard or the merged global tensor at a time. Legacy files
are pickles of argparse namespaces (Megatron loads them with weights_only=False, and so must this
reader): convert only checkpoints you trust.
"""

import argparse
import copy
import io
import os
import re

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.conversion.formats import read_mapped, torch_to_float32
from ascend_llm_recipes.models.conversion.tables import (FUSE, GROUPED_EXPERTS, MEGATRON_TENSORS, TE_GROUPED_EXPERTS,
                                                         is_expert, join_ranks, layer_names, one_expert,
                                                         present_tensors, rank_share)


LATEST_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
EXTRA_STATE = "._extra_state"  # TransformerEngine/FP8 bookkeeping, never weights


def iteration_dir(ckpt_dir: str, iteration: int = None) -> tuple:
    """(iter_NNNNNNN directory, iteration) for a Megatron save directory or an iteration directory."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    if iteration is not None and iteration < 0:
        raise ConversionError(f"{ckpt_dir}: --iteration {iteration}: must be 0 or more")
    if not os.path.isdir(ckpt_dir):
        raise ConversionError(f"{ckpt_dir}: not a directory (expected a Megatron save directory or an "
                              "iter_NNNNNNN directory)")
    match = re.fullmatch(r"iter_(\d{7})", os.path.basename(ckpt_dir))
    if match:
        if iteration is not None and iteration != int(match.group(1)):
            raise ConversionError(f"{ckpt_dir}: --iteration {iteration} differs from the directory's iteration")
        return ckpt_dir, int(match.group(1))
    if iteration is None:
        latest = os.path.join(ckpt_dir, LATEST_FILE)
        try:
            with open(latest, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            found = sorted(d for d in os.listdir(ckpt_dir) if re.fullmatch(r"iter_\d{7}", d))
            raise ConversionError(f"{ckpt_dir}: no {LATEST_FILE} (iterations present: {found or 'none'})",
                                  hint="pass --iteration N or the iter_NNNNNNN directory itself") from None
        if text == "release":
            return os.path.join(ckpt_dir, "release"), 0
        if not text.isdigit():
            raise ConversionError(f"{latest}: expected an iteration number or 'release', found {text[:40]!r}")
        iteration = int(text)
    path = os.path.join(ckpt_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise ConversionError(f"{path}: missing", hint="pass --iteration with an iteration that was saved")
    return path, iteration


def kv_groups(args: dict) -> tuple:
    """(KV groups, head_dim) of a Megatron model from its arguments (the fused qkv's layout): head_dim is
    kv_channels when given (Qwen3's explicit head_dim), else hidden_size / num_attention_heads."""
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    return groups or heads, args.get("kv_channels") or args["hidden_size"] // heads


def open_megatron(ckpt_dir: str, iteration: int = None):
    """The checkpoint of `ckpt_dir` as a LegacyCheckpoint or a TorchDistCheckpoint (indexes only, no tensors).

    Use it as a context manager (`with open_megatron(...) as ckpt:`): closing releases the files it holds open.
    """
    path, iteration = iteration_dir(ckpt_dir, iteration)
    if os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, ".metadata")):
        return TorchDistCheckpoint(path, iteration)
    if any(re.fullmatch(r"mp_rank_\d\d(_\d\d\d){0,2}", d) for d in os.listdir(path)):
        return LegacyCheckpoint(path, iteration)
    raise ConversionError(f"{path}: neither a torch_dist checkpoint (metadata.json, .metadata, *.distcp) nor "
                          "legacy mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt files")


def _torch_load(path: str, **kwargs):
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, **kwargs)
    except Exception as err:  # torch raises RuntimeError, pickle, zip and import errors alike
        raise ConversionError(f"{path}: cannot be read by torch.load ({type(err).__name__}: {err})",
                              hint="the file may be truncated or written by another program") from None


class MegatronCheckpoint:
    """What both formats share: `with` closes the checkpoint, releasing the files it holds open."""

    def close(self) -> None:
        """Release what reading holds (nothing, unless a format keeps files open)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LegacyCheckpoint(MegatronCheckpoint):
    """mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt files; tensors read one shard at a time.

    Megatron-LM (training/checkpointing.py get_checkpoint_name) appends _PPP when pipeline_model_parallel_size
    > 1 and _EEE when expert_model_parallel_size > 1. Each expert-parallel rank's file holds the whole model
    but only its E / EP routed experts, numbered locally: global expert g is local expert g % (E / EP) of
    rank g // (E / EP). Everything else is read from expert-parallel rank 0. GroupedMLP's files (--moe-grouped-gemm
    without TransformerEngine) hold a layer's local experts in weight1/weight2 (tables.GROUPED_EXPERTS): each
    expert is cut out of them as SequentialMLP holds it.

    Each rank file is loaded (torch.load, memory-mapped) once and kept until close(): a conversion reads
    every tensor several times (the index, the weights, the --verify forward, the optimizer's step and
    both Adam moments), and unpickling a rank file costs the same whatever tensor is wanted. Each shard
    read is copied out and its pages released (formats.read_mapped), so memory holds the tensors being merged,
    not the files.
    """

    format = "megatron-legacy"
    source = "model"  # or "exp_avg" / "exp_avg_sq": shard() reads that Adam moment of each parameter instead

    def __init__(self, path: str, iteration: int):
        self.path, self.iteration = path, iteration
        self._states = {}  # rank file path -> its torch.load result, until close() (shared with moments() views)
        self.ep = 1
        first = next((f for f in (os.path.join(path, d, RANK_FILE) for d in ("mp_rank_00", "mp_rank_00_000",
                                                                             "mp_rank_00_000_000"))
                      if os.path.isfile(f)), self._file(0, 0))
        state = self._state(first)
        self.args = _args_of(state, first)
        self.tp, self.pp = self.args["tensor_model_parallel_size"], self.args["pipeline_model_parallel_size"]
        self.ep = self.args.get("expert_model_parallel_size") or 1
        self.files = [os.path.relpath(self._file(t, p, e), path) for p in range(self.pp) for e in range(self.ep)
                      for t in range(self.tp)]
        missing = [f for f in self.files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ConversionError(f"{path}: missing rank file(s) {', '.join(missing)} for tensor_model_parallel_size "
                                  f"{self.tp} x pipeline_model_parallel_size {self.pp}" +
                                  (f" x expert_model_parallel_size {self.ep}" if self.ep > 1 else ""),
                                  hint="copy every mp_rank_* directory of the iteration")
        self.stage_layers = []  # per pipeline stage: its global layer numbers (stages number layers locally)
        self.index = {}         # (tp, pp, ep) -> {name: shape}
        for p in range(self.pp):
            for t in range(self.tp):
                for e in range(self.ep):
                    self.index[t, p, e] = self._index(t, p, e)
            local = sorted({int(m.group(1)) for name in self.index[0, p, 0]
                            for m in [re.match(r"decoder\.layers\.(\d+)\.", name)] if m})
            offset = sum(len(s) for s in self.stage_layers)
            self.stage_layers.append([offset + n for n in local])
        self._refuse_te_grouped_experts()

    def _refuse_te_grouped_experts(self) -> None:
        """TEGroupedMLP's per-expert linear_fc1.weight0..N: refused by name (no test checkpoint can be made here)."""
        found = next((f"{os.path.relpath(self._file(*rank), self.path)}: {name}" for rank, names in self.index.items()
                      for name in names if re.fullmatch(TE_GROUPED_EXPERTS, name)), None)
        if found:
            raise ConversionError(
                f"{found}: TransformerEngine's grouped-GEMM experts (TEGroupedMLP: --moe-grouped-gemm with "
                "--transformer-impl transformer_engine) are not read from legacy files: TransformerEngine does not run "
                "on this converter's CPU test machines, so no real file of this layout has been checked",
                hint="save it again as torch_dist, where TEGroupedMLP writes SequentialMLP's per-expert keys, and "
                     "convert that: start Megatron-LM's training script as for this run with --load pointing here, "
                     "--ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR")

    def _state(self, path: str):
        """A rank file's torch.load result (memory-mapped), loaded on first use and kept until close()."""
        if path not in self._states:
            self._states[path] = _torch_load(path, mmap=True)
        return self._states[path]

    def close(self) -> None:
        self._states.clear()

    def _file(self, t: int, p: int, e: int = 0) -> str:
        if self.ep > 1:
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + f"_{e:03d}"
        else:
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if os.path.isdir(os.path.join(self.path, f"mp_rank_{t:02d}_000"))
                                         else "")
        return os.path.join(self.path, name, RANK_FILE)

    def _model(self, state: dict, path: str) -> dict:
        if "model" not in state:
            chunks = sorted(k for k in state if re.fullmatch(r"model\d+", k))
            extra = f" but {chunks}: virtual pipeline chunks are not supported" if chunks else ""
            raise ConversionError(f"{path}: no 'model' entry{extra}")
        return state["model"]

    def _index(self, t: int, p: int, e: int = 0) -> dict:
        path = self._file(t, p, e)
        state = self._state(path)
        found = {}
        for name, value in self._model(state, path).items():
            if name.endswith(EXTRA_STATE):
                continue
            if not hasattr(value, "shape"):
                raise ConversionError(f"{path}: {name}: a {type(value).__name__}, not a tensor")
            found[name] = tuple(value.shape)
        return found

    def layer_location(self, layer: int) -> tuple:
        """(pipeline stage, local layer number) of a global layer."""
        for p, layers in enumerate(self.stage_layers):
            if layer in layers:
                return p, layers.index(layer)
        raise ConversionError(f"{self.path}: no pipeline stage holds layer {layer} (stages hold "
                              f"{[len(s) for s in self.stage_layers]} layers)")

    def expert_location(self, expert: int) -> tuple:
        """(expert-parallel rank, local expert number) of a global routed expert (0 and None: not an expert)."""
        if expert is None:
            return 0, None
        per_rank = self.args["num_experts"] // self.ep
        return expert // per_rank, expert % per_rank

    def names(self, kind: str, layer: int = None, expert: int = None) -> tuple:
        """(stage, candidate names) of one Megatron tensor in the rank files."""
        if layer is None:
            return (self.pp - 1 if MEGATRON_TENSORS[kind].stage == "last" else 0), layer_names(kind)
        stage, local = self.layer_location(layer)
        return stage, layer_names(kind, local, self.expert_location(expert)[1])

    def find(self, kind: str, layer: int = None, expert: int = None) -> tuple:
        stage, names = self.names(kind, layer, expert)
        name = next((n for n in names if n in self.index[0, stage, self.expert_location(expert)[0]]), None)
        return stage, name

    def shard(self, kind: str, layer: int, tp_rank: int, expert: int = None) -> np.ndarray:
        """One rank's tensor as stored in its file (a copy; the file pages it was read from are released).

        `expert`: the global number of a routed expert's tensor, read from the expert-parallel rank holding it."""
        stage, name = self.find(kind, layer, expert)
        ep_rank, local_expert = self.expert_location(expert)
        path = self._file(tp_rank, stage, ep_rank)
        stacked = self._stacked(kind, layer) if name is None else None
        name = stacked.name.format(n=self.layer_location(layer)[1]) if stacked else name
        if name is None or name not in self.index[tp_rank, stage, ep_rank]:
            raise ConversionError(f"{path}: {' or '.join(self.names(kind, layer, expert)[1])}: missing")
        state = self._state(path)
        tensors = self._model(state, path) if self.source == "model" else optimizer_moments(state, path, self.source)
        if stacked:  # GroupedMLP: this expert's part only is copied out
            return read_mapped(one_expert(tensors[name], self.args["num_experts"] // self.ep, local_expert,
                                          stacked.hidden_axis))
        return read_mapped(tensors[name])

    def _stacked(self, kind: str, layer: int):
        """GroupedMLP's tensor holding `kind` (a routed expert's) at `layer`, if the files hold it (else None)."""
        stacked = GROUPED_EXPERTS.get(kind)
        if stacked is None:
            return None
        stage, local = self.layer_location(layer)
        return stacked if stacked.name.format(n=local) in self.index[0, stage, 0] else None

    def moments(self, key: str) -> "LegacyCheckpoint":
        """This checkpoint with `key` (exp_avg or exp_avg_sq) in place of each weight: merged as the weights are.

        The view shares the checkpoint's loaded files (and close()).
        """
        view = copy.copy(self)
        view.source = key
        return view

    def optimizer_step(self) -> int:
        """Adam's step count in every rank file, checked to be one number; raises ConversionError naming why not."""
        steps = set()
        for p in range(self.pp):
            for t in range(self.tp):
                path = self._file(t, p, 0)
                state = self._state(path)
                optimizer_moments(state, path, "exp_avg")
                steps |= {int(entry["step"]) for entry in state["optimizer"]["state"].values()}
        if len(steps) != 1:
            raise ConversionError(f"{self.path}: Adam step counts differ between parameters ({sorted(steps)})")
        return steps.pop()

    def merged(self, kind: str, layer: int = None, fc1_merge: str = "per_rank", expert: int = None) -> np.ndarray:
        """The global tensor in torch_dist's convention, from the TP shards read one at a time.

        fc1_merge="concat" stacks the ranks' [gate; up] blocks as they are: wrong for TP > 1, kept to
        show that only a logits comparison catches it.
        """
        spec = MEGATRON_TENSORS[kind]
        if spec.split is None:  # norms are replicated: every rank must hold the same values
            first = self.shard(kind, layer, 0, expert)
            for t in range(1, self.tp):
                if not np.array_equal(first, self.shard(kind, layer, t, expert)):
                    raise ConversionError(f"{self.path}: {self.find(kind, layer, expert)[1]} differs between "
                                          f"tensor-parallel ranks 0 and {t} (replicated weights must agree)")
            return first
        shards = [self.shard(kind, layer, t, expert) for t in range(self.tp)]
        if fc1_merge == "concat":
            return np.concatenate(shards, axis=spec.split)
        return join_ranks(spec, shards, *kv_groups(self.args))

    def unknown_tensors(self, cfg) -> list:
        """Names in the rank files that no row consumes (biases other than q/k/v, ...)."""
        known = set()
        kinds = present_tensors(MEGATRON_TENSORS, cfg, keep_output=True)
        local_experts = range(cfg.num_experts // self.ep)
        for p in range(self.pp):
            stages = {"first"} if p == 0 else set()
            stages |= {"last"} if p == self.pp - 1 else set()
            known |= {n for kind in kinds if MEGATRON_TENSORS[kind].stage in stages for n in layer_names(kind)}
            for local in range(len(self.stage_layers[p])):
                known |= {n for kind in kinds if MEGATRON_TENSORS[kind].stage is None
                          for e in (local_experts if is_expert(kind) else (None,)) for n in layer_names(kind, local, e)}
                known |= {GROUPED_EXPERTS[kind].name.format(n=local) for kind in kinds if kind in GROUPED_EXPERTS}
        return [f"{os.path.relpath(self._file(t, p, e), self.path)}: {name}" for (t, p, e), names in self.index.items()
                for name in names if name not in known]


class TorchDistCheckpoint(MegatronCheckpoint):
    """A torch_dist directory: global tensors (layers stacked on axis 0), read chunk by chunk without a process group.

    Each saved chunk is a small torch.save stream inside a .distcp file (torch.distributed.checkpoint's
    FileSystemWriter); reading only the chunks of one layer keeps memory at one layer's tensor. A model whose
    layers differ (MoE with dense layers) is saved layer by layer (decoder.layers.N.*, no layer axis); routed
    experts are one tensor per layer with the global expert number on the next axis (mlp.experts.experts.*), as
    SequentialMLP, GroupedMLP and TEGroupedMLP all save them (megatron-core transformer/moe/experts.py).
    """

    format = "megatron-torch_dist"

    def __init__(self, path: str, iteration: int):
        from torch.distributed.checkpoint import FileSystemReader

        self.path, self.iteration = path, iteration
        try:
            self.reader = FileSystemReader(path)
            self.metadata = self.reader.read_metadata()
            self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        except Exception as err:
            raise ConversionError(f"{path}: unreadable torch_dist metadata ({type(err).__name__}: {err})") from None
        common = _torch_load(os.path.join(path, "common.pt"))
        self.args = _args_of(common, os.path.join(path, "common.pt"))
        self.tp, self.pp = self.args["tensor_model_parallel_size"], self.args["pipeline_model_parallel_size"]
        self.ep = self.args.get("expert_model_parallel_size") or 1  # recorded only: the tensors are global
        self.files = sorted(f for f in os.listdir(path) if f.endswith(".distcp") or f in ("common.pt", "metadata.json"))
        self.tensors = {}  # name -> global shape
        for name, meta in self.metadata.state_dict_metadata.items():
            if EXTRA_STATE + "/" in name + "/" or not hasattr(meta, "chunks"):
                continue
            self.tensors[name] = tuple(meta.size)

    def candidates(self, kind: str, layer: int = None) -> list:
        """[(name, its leading index axes)]: stacked over layers, or layer `layer`'s own; experts on an axis."""
        expert = ["expert"] if is_expert(kind) else []
        names = [n for n in MEGATRON_TENSORS[kind].names if "{e}" not in n]  # legacy's per-expert names: not here
        stacked = [(n.replace(".{n}.", "."), (["layer"] if layer is not None and "{n}" in n else []) + expert)
                   for n in names]
        return stacked + ([(n.format(n=layer), expert) for n in names if "{n}" in n] if layer is not None else [])

    def find(self, kind: str, layer: int = None, expert: int = None) -> tuple:
        return None, next((n for n, _ in self.candidates(kind, layer) if n in self.tensors), None)

    def merged(self, kind: str, layer: int = None, fc1_merge: str = "per_rank", expert: int = None) -> np.ndarray:
        """The global tensor (one layer of a stacked one, one expert of an experts' one), from its saved chunks."""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        name, axes = next(((n, a) for n, a in self.candidates(kind, layer) if n in self.tensors), (None, None))
        if name is None:
            wanted = layer_names(kind)[0]
            raise ConversionError(f"{self.path}: {wanted}: missing")
        size = self.tensors[name]
        wanted = [{"layer": layer, "expert": expert}[axis] for axis in axes]  # one index on each leading axis
        stacked = bool(axes)
        shape = size[len(axes):]
        out = np.empty(shape, np.float32)
        filled = 0
        for chunk in self.metadata.state_dict_metadata[name].chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if stacked:
                if not all(o <= w < o + n for o, n, w in zip(offsets, sizes, wanted)):
                    continue
                rows = tuple(slice(w - o, w - o + 1) for o, w in zip(offsets, wanted))
            info = self.reader.storage_data[MetadataIndex(name, torch.Size(offsets))]
            if getattr(info, "transform_descriptors", None):
                raise ConversionError(f"{self.path}: {name} is stored with transforms {info.transform_descriptors}; "
                                      "only plain torch_dist files are read")
            fd = os.open(os.path.join(self.path, info.relative_path), os.O_RDONLY)
            try:
                data = os.pread(fd, info.length, info.offset)
            finally:
                os.close(fd)
            piece = torch_to_float32(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
            if stacked:
                piece = piece[rows].reshape(piece.shape[len(axes):])
                offsets, sizes = offsets[len(axes):], sizes[len(axes):]
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
            filled += piece.size
        if filled != out.size:
            raise ConversionError(f"{self.path}: {name}" + (f" at {dict(zip(axes, wanted))}" if stacked else "") +
                                  f": saved chunks cover {filled} of {out.size} values")
        return out

    def shard(self, kind: str, layer: int, tp_rank: int, expert: int = None) -> np.ndarray:
        """What tensor-parallel rank tp_rank held (legacy's per-rank layout), cut from the global tensor."""
        full = self.merged(kind, layer, expert=expert)
        spec = MEGATRON_TENSORS[kind]
        if spec.split is None:
            return full
        groups, head_dim = kv_groups(self.args)
        parts = FUSE[spec.fuse][1](full, groups, head_dim) if spec.fuse else {None: full}
        return rank_share(spec, [parts[row.part] for row in spec.rows], tp_rank, self.tp, groups, head_dim)

    def unknown_tensors(self, cfg) -> list:
        known = {n for kind in present_tensors(MEGATRON_TENSORS, cfg, keep_output=True)
                 for layer in (None, *range(cfg.num_layers)) for n, _ in self.candidates(kind, layer)}
        return [name for name in self.tensors if name not in known]


def optimizer_moments(state: dict, path: str, key: str) -> dict:
    """{parameter name: Adam moment `key`} of a legacy rank file's non-distributed optimizer state.

    optimizer.state_dict() (megatron/training/checkpointing.py, generate_state_dict) numbers the
    parameters and does not name them; megatron.core.optimizer._get_param_groups orders them as the
    model's parameters, weight-decayed ones first, then 1-D and bias ones (wd_mult 0). That order is
    rebuilt here and checked against the saved groups and every moment's shape.
    """
    optimizer = state.get("optimizer")
    if optimizer is None:
        raise ConversionError(f"{path}: no optimizer state (saved with --no-save-optim, or by a distributed "
                              "optimizer into distrib_optim.pt)")
    if not isinstance(optimizer, dict) or not {"state", "param_groups"} <= set(optimizer):
        raise ConversionError(f"{path}: optimizer state of another layout ({type(optimizer).__name__}: several "
                              "chained optimizers or a mixed-precision wrapper are not read)")
    model = {n: v for n, v in state["model"].items() if not n.endswith(EXTRA_STATE) and v is not None}
    decayed = [n for n, v in model.items() if v.dim() > 1 and not n.endswith(".bias")]
    plain = [n for n in model if n not in set(decayed)]
    groups = [g for g in (decayed, plain) if g]
    saved = optimizer["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g) for g in groups] or \
            [g.get("wd_mult", 1.0) == 0.0 for g in saved] != [g is plain for g in groups]:
        raise ConversionError(f"{path}: optimizer parameter groups {[len(g['params']) for g in saved]} do not match "
                              f"Megatron's default grouping of the model's parameters {[len(g) for g in groups]} "
                              "(custom lr/wd overrides are not supported)")
    moments = {}
    for name, index in zip([n for g in groups for n in g], [i for g in saved for i in g["params"]]):
        entry = optimizer["state"].get(index)
        if entry is None or key not in entry:
            raise ConversionError(f"{path}: optimizer state holds no {key} for {name} (parameter {index}): the "
                                  "optimizer never stepped")
        if tuple(entry[key].shape) != tuple(model[name].shape):
            raise ConversionError(f"{path}: optimizer {key} of parameter {index} has shape {tuple(entry[key].shape)}, "
                                  f"{name} has {tuple(model[name].shape)}")
        moments[name] = entry[key]
    return moments


def _args_of(state, path: str) -> dict:
    """The checkpoint's Megatron-LM arguments as a dict."""
    args = state.get("args") if isinstance(state, dict) else None
    if args is None:
        raise ConversionError(f"{path}: no 'args' entry: the architecture cannot be read from this checkpoint",
                              hint="Megatron-LM saves its arguments with every checkpoint; was it written by "
                                   "another tool?")
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
