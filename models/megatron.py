"""Megatron-LM checkpoints -> ours, and ours -> Megatron-LM (legacy format).

    from_megatron(CKPT_DIR, OUT_DIR)  a Megatron save directory (latest_checkpointed_iteration.txt)
                                      or one iter_NNNNNNN directory, legacy or torch_dist
    to_megatron(CKPT, cfg, OUT_DIR, tp, pp)  legacy mp_rank_TT[_PPP]/model_optim_rng.pt files

training/tools/export.py resolves what a user names (a run directory, a recipe as --model-config) into
these functions' arguments and writes the recipe continuing a converted run (--write-recipe).

Output is what models/convert.py's --from-hf writes (weights.safetensors, model_config.yaml,
conversion.json), through its write_ours: the Megatron tensors are presented under HuggingFace names
(MegatronWeights) and everything downstream is shared. to_megatron publishes through the same
write_conversion (hidden sibling directory, atomic rename, OSError reported by name).

Megatron's layouts (megatron-core transformer/attention.py and mlp.py, local or TransformerEngine
spec): `linear_qkv` rows are grouped per KV group, [q_1 .. q_{heads/groups}, k, v] x head_dim for
each group, and each tensor-parallel rank holds whole groups, so concatenating the ranks keeps that
layout; `linear_fc1` is [gate; up] per rank in legacy files and [gate of all ranks; up of all ranks]
in torch_dist; `linear_proj` and `linear_fc2` are split on their input dimension; the vocabulary
tables are split on rows and padded to make_vocab_size_divisible_by x TP. Rotary embeddings use
the same half-split layout as ours (rotary_interleaved False), so nothing is permuted.

Legacy files are pickles of argparse namespaces (Megatron loads them with weights_only=False, and so
must this reader): convert only checkpoints you trust.
"""

import argparse
import copy
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.arithmetic import round_up
from ascend_llm_recipes.models.checkpoint_io import CkptFile, SafetensorsFile
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.convert import (FORMAT_VERSION, MANIFEST_FILE, MOMENT_FILES, OPTIMIZER_DIR,
                                               TRANSFORMS, HFWeights, progress_bar, tensor_plan, verify_against,
                                               write_conversion, write_ours)

LATEST_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
EXTRA_STATE = "._extra_state"  # TransformerEngine/FP8 bookkeeping, never weights


@dataclass(frozen=True)
class MegatronTensor:
    """One tensor of a Megatron-core GPT model: its names, its tensor-parallel split and how HF parts fuse into it."""

    names: tuple        # the first is written (local spec); the others are read too (TransformerEngine spec)
    tp_dim: int = None  # the dimension tensor-parallel ranks split; None: replicated on every rank
    fuse: str = None    # how its HF parts make one rank's tensor (FUSE); None: a single part
    stage: str = None   # a tensor outside the layers: the pipeline stage holding it ("first", "last")


# The Megatron-core table (megatron-core gpt_layer_specs.py, local and TransformerEngine specs), in the order
# rank files are written. Norms fused into the next linear (TransformerEngine) are read under their second name.
MEGATRON_TENSORS = {
    "embedding": MegatronTensor(("embedding.word_embeddings.weight",), tp_dim=0, stage="first"),
    "input_norm": MegatronTensor(("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")),
    "mlp_norm": MegatronTensor(("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")),
    "qkv": MegatronTensor(("self_attention.linear_qkv.weight",), tp_dim=0, fuse="qkv"),
    "qkv_bias": MegatronTensor(("self_attention.linear_qkv.bias",), tp_dim=0, fuse="qkv"),
    "proj": MegatronTensor(("self_attention.linear_proj.weight",), tp_dim=1),
    "fc1": MegatronTensor(("mlp.linear_fc1.weight",), tp_dim=0, fuse="gate_up"),
    "fc2": MegatronTensor(("mlp.linear_fc2.weight",), tp_dim=1),
    "final_norm": MegatronTensor(("decoder.final_layernorm.weight",), stage="last"),
    "output": MegatronTensor(("output_layer.weight",), tp_dim=0, stage="last"),
}

# HF name (as in convert.KEY_MAP) -> (Megatron kind, part). Parts: q/k/v of the grouped qkv, gate/up of fc1
# (in fusing order), vocab: rows padded to make_vocab_size_divisible_by x TP. Reading and writing both follow it.
HF_FROM_MEGATRON = {
    "model.embed_tokens.weight": ("embedding", "vocab"),
    "model.layers.{n}.input_layernorm.weight": ("input_norm", None),
    "model.layers.{n}.self_attn.q_proj.weight": ("qkv", "q"),
    "model.layers.{n}.self_attn.k_proj.weight": ("qkv", "k"),
    "model.layers.{n}.self_attn.v_proj.weight": ("qkv", "v"),
    "model.layers.{n}.self_attn.q_proj.bias": ("qkv_bias", "q"),
    "model.layers.{n}.self_attn.k_proj.bias": ("qkv_bias", "k"),
    "model.layers.{n}.self_attn.v_proj.bias": ("qkv_bias", "v"),
    "model.layers.{n}.self_attn.o_proj.weight": ("proj", None),
    "model.layers.{n}.post_attention_layernorm.weight": ("mlp_norm", None),
    "model.layers.{n}.mlp.gate_proj.weight": ("fc1", "gate"),
    "model.layers.{n}.mlp.up_proj.weight": ("fc1", "up"),
    "model.layers.{n}.mlp.down_proj.weight": ("fc2", None),
    "model.norm.weight": ("final_norm", None),
    "lm_head.weight": ("output", "vocab"),
}
# Megatron kind -> [(part, HF name template)], the table read the other way: what writing fuses.
MEGATRON_PARTS = {kind: [(part, hf) for hf, (k, part) in HF_FROM_MEGATRON.items() if k == kind]
                  for kind in MEGATRON_TENSORS}


def megatron_kinds(qkv_bias: bool, tied: bool) -> list:
    """The kinds of MEGATRON_TENSORS a model holds (q/k/v bias only with add_qkv_bias, an output layer untied)."""
    return [kind for kind in MEGATRON_TENSORS if (qkv_bias or kind != "qkv_bias") and (not tied or kind != "output")]


def layer_names(kind: str, local: int = None) -> tuple:
    """Candidate names of a kind: `decoder.layers.{local}.` + name for a layer's tensor (layers. when stacked)."""
    spec = MEGATRON_TENSORS[kind]
    if spec.stage is not None:
        return spec.names
    prefix = "decoder.layers." if local is None else f"decoder.layers.{local}."
    return tuple(prefix + name for name in spec.names)


# Megatron-LM argument -> (the only supported value, why); checked before any tensor is read.
UNSUPPORTED_ARGS = (
    ("normalization", "RMSNorm", "the model uses RMSNorm, not LayerNorm"),
    ("swiglu", True, "the MLP is gated (SwiGLU); a non-gated MLP has no gate_proj"),
    ("position_embedding_type", "rope", "positions are rotary"),
    ("rotary_percent", 1.0, "rotary embeddings cover the whole head (rotary_percent < 1 rotates part of it)"),
    ("rotary_interleaved", False, "rotary pairs are half-split, not interleaved"),
    ("add_bias_linear", False, "the only biases the model has are q/k/v (add_qkv_bias)"),
    ("num_experts", None, "the MLP is dense (no mixture of experts)"),
    ("qk_layernorm", False, "the model has no query/key norms"),
    ("apply_layernorm_1p", False, "norm weights are used as stored (no 1 + weight)"),
    ("virtual_pipeline_model_parallel_size", None, "the reader expects one model chunk per pipeline stage"),
)
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size")


# --- Finding the checkpoint -------------------------------------------------------------------

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


def open_megatron(ckpt_dir: str, iteration: int = None):
    """The checkpoint of `ckpt_dir` as a LegacyCheckpoint or a TorchDistCheckpoint (indexes only, no tensors)."""
    path, iteration = iteration_dir(ckpt_dir, iteration)
    if os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, ".metadata")):
        return TorchDistCheckpoint(path, iteration)
    if any(re.fullmatch(r"mp_rank_\d\d(_\d\d\d)?", d) for d in os.listdir(path)):
        return LegacyCheckpoint(path, iteration)
    raise ConversionError(f"{path}: neither a torch_dist checkpoint (metadata.json, .metadata, *.distcp) nor "
                          "legacy mp_rank_TT[_PPP]/model_optim_rng.pt files")


def _torch_load(path: str, **kwargs):
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, **kwargs)
    except Exception as err:  # torch raises RuntimeError, pickle, zip and import errors alike
        raise ConversionError(f"{path}: cannot be read by torch.load ({type(err).__name__}: {err})",
                              hint="the file may be truncated or written by another program") from None


def _to_numpy(tensor) -> np.ndarray:
    import torch

    return tensor.detach().to(torch.float32).contiguous().numpy().copy()


class LegacyCheckpoint:
    """mp_rank_TT[_PPP]/model_optim_rng.pt files; tensors read one shard at a time, files re-mapped per read."""

    format = "megatron-legacy"
    source = "model"  # or "exp_avg" / "exp_avg_sq": shard() reads that Adam moment of each parameter instead

    def __init__(self, path: str, iteration: int):
        self.path, self.iteration = path, iteration
        first = self._file(0, 0)
        state = _torch_load(first, mmap=True)
        self.args = _args_of(state, first)
        self.tp, self.pp = self.args["tensor_model_parallel_size"], self.args["pipeline_model_parallel_size"]
        self.files = [os.path.relpath(self._file(t, p), path) for p in range(self.pp) for t in range(self.tp)]
        missing = [f for f in self.files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ConversionError(f"{path}: missing rank file(s) {', '.join(missing)} for tensor_model_parallel_size "
                                  f"{self.tp} x pipeline_model_parallel_size {self.pp}",
                                  hint="copy every mp_rank_* directory of the iteration")
        self.stage_layers = []  # per pipeline stage: its global layer numbers (stages number layers locally)
        self.index = {}         # (tp, pp) -> {name: shape}
        for p in range(self.pp):
            for t in range(self.tp):
                self.index[t, p] = self._index(t, p, state if (t, p) == (0, 0) else None)
            local = sorted({int(m.group(1)) for name in self.index[0, p]
                            for m in [re.match(r"decoder\.layers\.(\d+)\.", name)] if m})
            offset = sum(len(s) for s in self.stage_layers)
            self.stage_layers.append([offset + n for n in local])
        del state

    def _file(self, t: int, p: int) -> str:
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if os.path.isdir(os.path.join(self.path, f"mp_rank_{t:02d}_000"))
                                     else "")
        return os.path.join(self.path, name, RANK_FILE)

    def _model(self, state: dict, path: str) -> dict:
        if "model" not in state:
            chunks = sorted(k for k in state if re.fullmatch(r"model\d+", k))
            extra = f" but {chunks}: virtual pipeline chunks are not supported" if chunks else ""
            raise ConversionError(f"{path}: no 'model' entry{extra}")
        return state["model"]

    def _index(self, t: int, p: int, state) -> dict:
        path = self._file(t, p)
        state = state if state is not None else _torch_load(path, mmap=True)
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

    def names(self, kind: str, layer: int = None) -> tuple:
        """(stage, candidate names) of one Megatron tensor in the rank files."""
        if layer is None:
            return (self.pp - 1 if MEGATRON_TENSORS[kind].stage == "last" else 0), layer_names(kind)
        stage, local = self.layer_location(layer)
        return stage, layer_names(kind, local)

    def find(self, kind: str, layer: int = None) -> tuple:
        stage, names = self.names(kind, layer)
        name = next((n for n in names if n in self.index[0, stage]), None)
        return stage, name

    def shard(self, kind: str, layer: int, tp_rank: int) -> np.ndarray:
        """One rank's tensor as stored in its file (re-mapped per read, so memory holds this tensor only)."""
        stage, name = self.find(kind, layer)
        path = self._file(tp_rank, stage)
        if name is None or name not in self.index[tp_rank, stage]:
            raise ConversionError(f"{path}: {' or '.join(self.names(kind, layer)[1])}: missing")
        state = _torch_load(path, mmap=True)
        tensors = self._model(state, path) if self.source == "model" else optimizer_moments(state, path, self.source)
        return _to_numpy(tensors[name])

    def moments(self, key: str) -> "LegacyCheckpoint":
        """This checkpoint with `key` (exp_avg or exp_avg_sq) in place of each weight: merged as the weights are."""
        view = copy.copy(self)
        view.source = key
        return view

    def optimizer_step(self) -> int:
        """Adam's step count in every rank file, checked to be one number; raises ConversionError naming why not."""
        steps = set()
        for p in range(self.pp):
            for t in range(self.tp):
                path = self._file(t, p)
                state = _torch_load(path, mmap=True)
                optimizer_moments(state, path, "exp_avg")
                steps |= {int(entry["step"]) for entry in state["optimizer"]["state"].values()}
        if len(steps) != 1:
            raise ConversionError(f"{self.path}: Adam step counts differ between parameters ({sorted(steps)})")
        return steps.pop()

    def merged(self, kind: str, layer: int = None, fc1_merge: str = "per_rank") -> np.ndarray:
        """The global tensor in torch_dist's convention, from the TP shards read one at a time.

        fc1_merge="concat" stacks the ranks' [gate; up] blocks as they are: wrong for TP > 1, kept to
        show that only a logits comparison catches it.
        """
        spec = MEGATRON_TENSORS[kind]
        if spec.tp_dim is None:  # norms are replicated: every rank must hold the same values
            first = self.shard(kind, layer, 0)
            for t in range(1, self.tp):
                if not np.array_equal(first, self.shard(kind, layer, t)):
                    raise ConversionError(f"{self.path}: {self.find(kind, layer)[1]} differs between tensor-parallel "
                                          f"ranks 0 and {t} (replicated weights must agree)")
            return first
        shards = [self.shard(kind, layer, t) for t in range(self.tp)]
        if spec.fuse == "gate_up" and fc1_merge == "per_rank":
            halves = [np.split(s, 2, axis=0) for s in shards]
            return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
        return np.concatenate(shards, axis=spec.tp_dim)

    def unknown_tensors(self, qkv_bias: bool) -> list:
        """Names in the rank files that no rule consumes (biases other than q/k/v, MoE, ...)."""
        known = set()
        kinds = megatron_kinds(qkv_bias, tied=False)
        for p in range(self.pp):
            stages = {"first"} if p == 0 else set()
            stages |= {"last"} if p == self.pp - 1 else set()
            known |= {n for kind in kinds if MEGATRON_TENSORS[kind].stage in stages for n in layer_names(kind)}
            for local in range(len(self.stage_layers[p])):
                known |= {n for kind in kinds if MEGATRON_TENSORS[kind].stage is None
                          for n in layer_names(kind, local)}
        return [f"{self.files[p * self.tp + t]}: {name}" for (t, p), names in self.index.items()
                for name in names if name not in known]


class TorchDistCheckpoint:
    """A torch_dist directory: global tensors (layers stacked on axis 0), read chunk by chunk without a process group.

    Each saved chunk is a small torch.save stream inside a .distcp file (torch.distributed.checkpoint's
    FileSystemWriter); reading only the chunks of one layer keeps memory at one layer's tensor.
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
        self.files = sorted(f for f in os.listdir(path) if f.endswith(".distcp") or f in ("common.pt", "metadata.json"))
        self.tensors = {}  # name -> global shape
        for name, meta in self.metadata.state_dict_metadata.items():
            if EXTRA_STATE + "/" in name + "/" or not hasattr(meta, "chunks"):
                continue
            self.tensors[name] = tuple(meta.size)

    def find(self, kind: str, layer: int = None) -> tuple:
        return None, next((n for n in layer_names(kind) if n in self.tensors), None)

    def merged(self, kind: str, layer: int = None, fc1_merge: str = "per_rank") -> np.ndarray:
        """The global tensor (one layer of a stacked one), assembled from its saved chunks."""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        _, name = self.find(kind, layer)
        if name is None:
            wanted = MEGATRON_TENSORS[kind].names[0]
            raise ConversionError(f"{self.path}: {wanted}: missing")
        size = self.tensors[name]
        stacked = layer is not None
        shape = size[1:] if stacked else size
        out = np.empty(shape, np.float32)
        filled = 0
        for chunk in self.metadata.state_dict_metadata[name].chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if stacked:
                if not offsets[0] <= layer < offsets[0] + sizes[0]:
                    continue
                rows = slice(layer - offsets[0], layer - offsets[0] + 1)
            info = self.reader.storage_data[MetadataIndex(name, torch.Size(offsets))]
            if getattr(info, "transform_descriptors", None):
                raise ConversionError(f"{self.path}: {name} is stored with transforms {info.transform_descriptors}; "
                                      "only plain torch_dist files are read")
            fd = os.open(os.path.join(self.path, info.relative_path), os.O_RDONLY)
            try:
                data = os.pread(fd, info.length, info.offset)
            finally:
                os.close(fd)
            piece = _to_numpy(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
            if stacked:
                piece, offsets, sizes = piece[rows][0], offsets[1:], sizes[1:]
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
            filled += piece.size
        if filled != out.size:
            raise ConversionError(f"{self.path}: {name}" + (f" layer {layer}" if stacked else "") +
                                  f": saved chunks cover {filled} of {out.size} values")
        return out

    def shard(self, kind: str, layer: int, tp_rank: int) -> np.ndarray:
        """What tensor-parallel rank tp_rank held (legacy's per-rank layout), cut from the global tensor."""
        full = self.merged(kind, layer)
        spec = MEGATRON_TENSORS[kind]
        if spec.tp_dim is None:
            return full
        if spec.fuse == "gate_up":
            gate, up = np.split(full, 2, axis=0)
            return np.concatenate([np.split(gate, self.tp)[tp_rank], np.split(up, self.tp)[tp_rank]])
        return np.split(full, self.tp, axis=spec.tp_dim)[tp_rank]

    def unknown_tensors(self, qkv_bias: bool) -> list:
        known = {n for kind in megatron_kinds(qkv_bias, tied=False) for n in layer_names(kind)}
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


# --- Architecture from the arguments ----------------------------------------------------------

def model_config_from_args(args: dict, where: str, vocab_size: int = None) -> ModelConfig:
    """Megatron-LM arguments -> our model_config, refusing by name what the model cannot express."""
    problems = [f"{key}: missing" for key in REQUIRED_ARGS if args.get(key) is None]
    for key, supported, why in UNSUPPORTED_ARGS:
        value = args.get(key, supported)
        if key == "num_experts" and not value:
            continue
        if value != supported:
            problems.append(f"{key}: {value!r} is not supported ({supported!r} only): {why}")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} unsupported or missing argument(s):\n" +
                              "\n".join(f"  - {p}" for p in problems),
                              hint="only Llama-style Megatron models convert: RMSNorm, rotary positions, SwiGLU, "
                                   "optional q/k/v bias")
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    groups = groups or heads
    tp = args["tensor_model_parallel_size"]
    if args.get("kv_channels") not in (None, hidden // heads) or hidden % heads:
        problems.append(f"kv_channels: {args.get('kv_channels')} with hidden_size {hidden} and {heads} heads is not "
                        "supported: the model uses head_dim = hidden_size / num_attention_heads")
    if groups < tp:
        problems.append(f"num_query_groups: {groups} KV groups are fewer than tensor_model_parallel_size {tp} "
                        "(replicated KV heads are not supported)")
    padded = args.get("padded_vocab_size")
    vocab = vocab_size or args.get("vocab_size")
    if vocab is None:
        problems.append(f"vocab_size: not recorded in the arguments (padded_vocab_size {padded} includes padding "
                        "rows): pass --vocab-size with the tokenizer's vocabulary size")
    elif padded is not None and vocab > padded:
        problems.append(f"vocab_size: {vocab} exceeds the checkpoint's padded_vocab_size {padded}")
    if args.get("max_position_embeddings") and args["seq_length"] > args["max_position_embeddings"]:
        problems.append(f"seq_length: {args['seq_length']} exceeds max_position_embeddings "
                        f"{args['max_position_embeddings']}")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=args["num_layers"], num_heads=heads,
                       num_kv_heads=groups, intermediate_size=args.get("ffn_hidden_size") or 4 * hidden,
                       seq_length=args["seq_length"], rms_norm_eps=float(args.get("norm_epsilon", 1e-5)),
                       rope_theta=float(args.get("rotary_base", 10000)),
                       initializer_range=float(args.get("init_method_std", 0.02)),
                       tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False),
                       qkv_bias=bool(args.get("add_qkv_bias", False)))


def json_args(args: dict) -> dict:
    """The arguments that JSON can hold (for conversion.json and the way back to Megatron)."""
    return {k: v for k, v in args.items() if v is None or isinstance(v, (bool, int, float, str))}


# --- Megatron tensors under HuggingFace names ------------------------------------------------

class MegatronWeights(HFWeights):
    """A Megatron checkpoint seen as HuggingFace-named tensors, so convert.py's writer consumes it.

    qkv_layout="grouped" is Megatron's; "separate" (all q rows, then k, then v) is the common mistake,
    kept so that tests can show the parity check rejects it.
    """

    def __init__(self, ckpt, cfg: ModelConfig, qkv_layout: str = "grouped", fc1_merge: str = "per_rank"):
        self.ckpt, self.cfg, self.qkv_layout, self.fc1_merge = ckpt, cfg, qkv_layout, fc1_merge
        self._cache = (None, None)  # the last merged tensor: q, k and v come from one qkv
        plan = tensor_plan(cfg)
        super().__init__(ckpt.format, ckpt.files, {p.hf: (self, "F32", p.hf_shape) for p in plan})
        self.sources = {p.hf: self.source_of(p.hf) for p in plan}

    def source_of(self, hf_name: str) -> tuple:
        """(kind, layer, part) of the Megatron tensor behind an HF name."""
        match = re.search(r"\.layers\.(\d+)\.", hf_name)
        layer = int(match.group(1)) if match else None
        pattern = hf_name.replace(f".layers.{layer}.", ".layers.{n}.") if match else hf_name
        kind, part = HF_FROM_MEGATRON[pattern]
        return kind, layer, part

    def read(self, name: str) -> np.ndarray:
        kind, layer, part = self.sources[name]
        if self._cache[0] != (kind, layer):
            self._cache = (None, None)  # drop the previous one first: one merged tensor alive at a time
            self._cache = ((kind, layer), self.ckpt.merged(kind, layer, self.fc1_merge))
        full = self._cache[1]
        if part == "vocab":
            return np.ascontiguousarray(full[:self.cfg.vocab_size])
        fuse = MEGATRON_TENSORS[kind].fuse
        if fuse == "qkv":
            return split_qkv(full, self.cfg, self.qkv_layout)[part]
        if fuse is not None:
            return np.ascontiguousarray(UNFUSE[fuse](full, self.cfg)[part])
        return full


def split_qkv(fused: np.ndarray, cfg: ModelConfig, layout: str = "grouped") -> dict:
    """Megatron's fused qkv (weight or bias, rows first) -> q, k, v in our (= HF) row order."""
    head_dim = cfg.hidden_size // cfg.num_heads
    groups = cfg.kv_heads
    per_group = cfg.num_heads // groups
    rest = fused.shape[1:]
    if layout == "separate":
        q, k, v = np.split(fused, [cfg.num_heads * head_dim, (cfg.num_heads + groups) * head_dim])
        return {"q": q, "k": k, "v": v}
    # (groups x (per_group + 2) x head_dim, ...) -> (groups, per_group + 2, head_dim, ...)
    grouped = fused.reshape(groups, per_group + 2, head_dim, *rest)
    return {"q": np.ascontiguousarray(grouped[:, :per_group].reshape(-1, *rest)),
            "k": np.ascontiguousarray(grouped[:, per_group].reshape(-1, *rest)),
            "v": np.ascontiguousarray(grouped[:, per_group + 1].reshape(-1, *rest))}


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, groups: int, head_dim: int) -> np.ndarray:
    """The inverse of split_qkv: HF q, k, v rows of `groups` KV groups -> Megatron's grouped fused rows."""
    rest = q.shape[1:]
    # (rows, ...) -> (groups, heads per group or 1, head_dim, ...), then [q..., k, v] per group
    grouped = np.concatenate([q.reshape(groups, -1, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                              v.reshape(groups, 1, head_dim, *rest)], axis=1)
    return grouped.reshape(-1, *rest)


# How a rank's parts (in MEGATRON_PARTS order) make its tensor, and back; `groups` are the rank's KV groups.
FUSE = {
    None: lambda parts, groups, head_dim: parts[0],
    "qkv": lambda parts, groups, head_dim: fuse_qkv(*parts, groups, head_dim),
    "gate_up": lambda parts, groups, head_dim: np.concatenate(parts),
}
UNFUSE = {"qkv": split_qkv, "gate_up": lambda full, cfg: dict(zip(("gate", "up"), np.split(full, 2, axis=0)))}


def rank_tensor(kind: str, parts: list, t: int, tp: int, cfg: ModelConfig, padded_vocab: int) -> np.ndarray:
    """What tensor-parallel rank t of tp holds of `kind`, from its HF parts [(part, tensor)] (MEGATRON_PARTS order).

    Each part is split on the table's tp_dim (vocabulary tables padded to padded_vocab rows first) and the
    rank's slices fused: so each rank holds whole KV groups and its own [gate; up] halves, as Megatron does.
    """
    spec = MEGATRON_TENSORS[kind]
    pieces = []
    for part, tensor in parts:
        if part == "vocab":
            padded = np.zeros((padded_vocab, *tensor.shape[1:]), np.float32)
            padded[:tensor.shape[0]] = tensor
            tensor = padded
        pieces.append(tensor if spec.tp_dim is None else np.split(tensor, tp, spec.tp_dim)[t])
    return FUSE[spec.fuse](pieces, cfg.kv_heads // tp, cfg.hidden_size // cfg.num_heads)


# --- Megatron -> ours -------------------------------------------------------------------------

def from_megatron(ckpt_dir: str, out_dir: str, iteration: int = None, vocab_size: int = None,
                  verify: bool = False, show_progress: bool = True, qkv_layout: str = "grouped",
                  fc1_merge: str = "per_rank") -> dict:
    """Convert a Megatron-LM checkpoint (legacy or torch_dist, any TP/PP) into OUT_DIR. Returns the manifest.

    With verify, our logits are compared with a pure-torch forward of the Megatron tensors as each
    tensor-parallel rank holds them, before OUT_DIR is published.
    """
    ckpt = open_megatron(ckpt_dir, iteration)
    cfg = model_config_from_args(ckpt.args, f"{ckpt.path} (args)", vocab_size)
    unknown = ckpt.unknown_tensors(cfg.qkv_bias)
    if unknown:
        raise ConversionError(f"{ckpt.path}: {len(unknown)} tensor(s) this converter does not know:\n" +
                              "\n".join(f"  - {u}" for u in unknown[:20]),
                              hint="only Llama-style models convert; _extra_state entries are ignored")
    weights = MegatronWeights(ckpt, cfg, qkv_layout, fc1_merge)
    source = {"path": ckpt.path, "format": ckpt.format, "iteration": ckpt.iteration,
              "tensor_model_parallel_size": ckpt.tp, "pipeline_model_parallel_size": ckpt.pp,
              "megatron_args": json_args(ckpt.args),
              "files": [{"file": f, "bytes": os.path.getsize(os.path.join(ckpt.path, f))} for f in ckpt.files]}
    check = (lambda work_dir: verify_against_megatron(ckpt, cfg, work_dir)) if verify else None
    moments, optimizer = carried_moments(ckpt, cfg, qkv_layout, fc1_merge)
    return write_ours(weights, cfg, out_dir, "from-megatron", source,
                      f"Converted from {ckpt.path} (Megatron {ckpt.format}, iteration {ckpt.iteration}, "
                      f"TP {ckpt.tp} x PP {ckpt.pp})", verify=check, show_progress=show_progress,
                      moments=moments, optimizer=optimizer)


def carried_moments(ckpt, cfg: ModelConfig, qkv_layout: str = "grouped", fc1_merge: str = "per_rank") -> tuple:
    """({our moment prefix: HF-named moments}, manifest "optimizer" entry) for the Adam state a checkpoint holds.

    Only legacy files of a non-distributed optimizer hold it per parameter; otherwise the entry says
    why the optimizer restarts.
    """
    restarts = "training restarts the optimizer (AdamW moments start at zero)"
    if not isinstance(ckpt, LegacyCheckpoint):
        return {}, {"carried": False, "note": f"{restarts}: optimizer state is read from legacy files only"}
    try:
        step = ckpt.optimizer_step()
    except ConversionError as err:
        return {}, {"carried": False, "note": f"{restarts}: {err.message}"}
    moments = {prefix: MegatronWeights(ckpt.moments(key), cfg, qkv_layout, fc1_merge)
               for prefix, key in MOMENT_FILES.items()}
    return moments, {"carried": True, "directory": OPTIMIZER_DIR, "global_step": step,
                     "note": f"Adam moments and step {step} carried over into {OPTIMIZER_DIR}/ (recipe key "
                             "load_optimizer_state)"}


# --- Parity with a pure-torch forward of the Megatron tensors ---------------------------------

def megatron_reference_logits(ckpt, cfg: ModelConfig, tokens: np.ndarray) -> np.ndarray:
    """Logits (batch, seq, vocab) of a pure-torch Megatron forward, tensor-parallel ranks simulated.

    Each rank computes with the shards it holds in Megatron's own layouts (grouped qkv, [gate; up]
    fc1) and the partial outputs of linear_proj and linear_fc2 are summed, as their all-reduce does;
    so the merge into our separate tensors is checked, not assumed.
    """
    import torch
    import torch.nn.functional as F

    def t(array):
        return torch.from_numpy(array).double()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    head_dim, groups, tp = cfg.hidden_size // cfg.num_heads, cfg.kv_heads, ckpt.tp
    per_group = cfg.num_heads // groups
    batch, seq = tokens.shape
    ids = torch.from_numpy(tokens).long()
    x = torch.cat([t(ckpt.shard("embedding", None, r)) for r in range(tp)])[ids]  # (B, S, H)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(v):  # (B, heads, S, head_dim), half-split pairs
        half = v.shape[-1] // 2
        return v * cos + torch.cat([-v[..., half:], v[..., :half]], -1) * sin

    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    for layer in range(cfg.num_layers):
        h = rms(x, t(ckpt.merged("input_norm", layer)))
        attn = 0
        for r in range(tp):
            qkv = h @ t(ckpt.shard("qkv", layer, r)).T
            if cfg.qkv_bias:
                qkv = qkv + t(ckpt.shard("qkv_bias", layer, r))
            # (B, S, local groups x (per_group + 2) x head_dim) -> (B, S, local groups, per_group + 2, head_dim)
            qkv = qkv.view(batch, seq, groups // tp, per_group + 2, head_dim)
            q = qkv[:, :, :, :per_group].reshape(batch, seq, -1, head_dim).transpose(1, 2)
            k = qkv[:, :, :, per_group].transpose(1, 2).repeat_interleave(per_group, 1)
            v = qkv[:, :, :, per_group + 1].transpose(1, 2).repeat_interleave(per_group, 1)
            scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(head_dim)
            context = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v  # (B, local heads, S, head_dim)
            attn = attn + context.transpose(1, 2).reshape(batch, seq, -1) @ t(ckpt.shard("proj", layer, r)).T
        x = x + attn
        h = rms(x, t(ckpt.merged("mlp_norm", layer)))
        mlp = 0
        for r in range(tp):
            gate, up = (h @ t(ckpt.shard("fc1", layer, r)).T).chunk(2, -1)
            mlp = mlp + (F.silu(gate) * up) @ t(ckpt.shard("fc2", layer, r)).T
        x = x + mlp
    x = rms(x, t(ckpt.merged("final_norm")))
    head = "embedding" if cfg.tie_word_embeddings else "output"
    weight = torch.cat([t(ckpt.shard(head, None, r)) for r in range(tp)])
    return (x @ weight.T)[..., :cfg.vocab_size].numpy()


def verify_against_megatron(ckpt, cfg: ModelConfig, converted_dir: str) -> dict:
    """Our logits against megatron_reference_logits on random tokens (convert.verify_against's rule)."""
    return verify_against(lambda tokens: megatron_reference_logits(ckpt, cfg, tokens), converted_dir, ckpt.path,
                          name="a pure-torch Megatron forward", label="the Megatron reference forward",
                          hint="nothing was written; the tensor layouts (qkv groups, fc1 halves) do not match this "
                               "checkpoint: report its args", max_tokens=64)


# --- ours -> Megatron (legacy) ----------------------------------------------------------------

def to_megatron(ckpt_path: str, cfg: ModelConfig, out_dir: str, tp: int = 1, pp: int = 1, iteration: int = None,
                source: str = None, section_path: str = None, show_progress: bool = True) -> dict:
    """Write Megatron-LM legacy files (mp_rank_TT[_PPP]/model_optim_rng.pt) for TP x PP, one rank file at a time.

    `source`: the converted directory whose conversion.json may hold the original Megatron arguments;
    `section_path`: where cfg was read, for the manifest. training/tools/export.py's to_megatron finds both.
    """
    import torch

    start = time.perf_counter()
    numbers = [f"--{name} {value}: must be a positive integer" for name, value in (("tp", tp), ("pp", pp))
               if type(value) is not int or value < 1]
    if iteration is not None and (type(iteration) is not int or iteration < 0):
        numbers.append(f"--iteration {iteration}: must be 0 or more (Megatron names iter_NNNNNNN directories by it)")
    if numbers:
        raise ConversionError(f"{ckpt_path}: " + "; ".join(numbers))
    ckpt = CkptFile(ckpt_path) if ckpt_path.endswith(".ckpt") else SafetensorsFile(ckpt_path)
    plan = {p.hf: p for p in tensor_plan(cfg)}
    problems = [f"{p.ours}: missing" for p in plan.values() if p.ours not in ckpt.tensors]
    groups = cfg.kv_heads
    for what, value in (("num_heads", cfg.num_heads), ("num_kv_heads", groups),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            problems.append(f"--tp {tp} does not divide {what} ({value})")
    if cfg.num_layers % pp:
        problems.append(f"--pp {pp} does not divide num_layers ({cfg.num_layers})")
    if problems:
        raise ConversionError(f"{ckpt_path}: cannot write TP {tp} x PP {pp}:\n" +
                              "\n".join(f"  - {p}" for p in problems))
    args = _megatron_args_for(cfg, tp, pp, source or os.path.dirname(ckpt_path), iteration)
    iteration = args["iteration"]
    padded = args["padded_vocab_size"]
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConversionError(f"output {out_dir} exists and is not empty", hint="choose another --output")
    iter_name = f"iter_{iteration:07d}" if iteration else "release"

    kinds = megatron_kinds(cfg.qkv_bias, cfg.tie_word_embeddings)

    def rank_state(p: int, t: int) -> dict:
        """Rank (t, p)'s tensors, generated from MEGATRON_TENSORS and HF_FROM_MEGATRON.

        In the order Megatron's model holds them: the embedding (first stage), each layer, the final norm and
        output layer (last stage).
        """
        first = cfg.num_layers // pp * p
        layers = [(n, n - first) for n in range(first, first + cfg.num_layers // pp)]
        state = {}
        for group in ("first", None, "last"):
            if group == "first" and p != 0 or group == "last" and p != pp - 1:
                continue
            for n, local in layers if group is None else [(None, None)]:
                for kind in (k for k in kinds if MEGATRON_TENSORS[k].stage == group):
                    parts = [(part, hf_tensor(name.format(n=n))) for part, name in MEGATRON_PARTS[kind]]
                    state[layer_names(kind, local)[0]] = rank_tensor(kind, parts, t, tp, cfg, padded)
        return state

    def hf_tensor(hf_name):
        item = plan[hf_name]
        return TRANSFORMS[item.transform][1](ckpt.read(item.ours), item.hf_shape)

    def write_files(work_dir: str) -> dict:
        with progress_bar(tp * pp, "write rank files", show_progress) as bar:
            for p in range(pp):
                for t in range(tp):
                    state = rank_state(p, t)
                    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                    os.makedirs(os.path.join(work_dir, iter_name, name))
                    torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0,
                                "iteration": iteration,
                                "model": {k: torch.from_numpy(np.array(v)) for k, v in state.items()}},
                               os.path.join(work_dir, iter_name, name, RANK_FILE))
                    del state
                    bar.update()
        with open(os.path.join(work_dir, LATEST_FILE), "w", encoding="utf-8") as f:
            f.write(str(iteration) if iteration else "release")
        return {"format_version": FORMAT_VERSION, "direction": "to-megatron",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "source": {"path": ckpt_path, "model_section": section_path}, "checkpoint": iter_name,
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "model": json_args(args), "tensors": [], "ignored": []}

    return write_conversion(out_dir, write_files, start=start)


def _megatron_args_for(cfg: ModelConfig, tp: int, pp: int, source: str, iteration: int = None) -> dict:
    """Megatron-LM arguments for cfg at TP x PP, starting from the original run's when it came from Megatron."""
    original = source_manifest(source).get("source", {})
    args = dict(original.get("megatron_args") or {})
    divisible = args.get("make_vocab_size_divisible_by", 128)
    groups = cfg.kv_heads
    args.update(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                group_query_attention=groups != cfg.num_heads, num_query_groups=groups,
                kv_channels=cfg.hidden_size // cfg.num_heads, ffn_hidden_size=cfg.intermediate_size,
                seq_length=cfg.seq_length, max_position_embeddings=max(cfg.seq_length,
                                                                       args.get("max_position_embeddings") or 0),
                position_embedding_type="rope", rotary_base=cfg.rope_theta, rotary_percent=1.0,
                rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=cfg.rms_norm_eps, swiglu=True,
                add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
                vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible,
                padded_vocab_size=round_up(cfg.vocab_size, divisible * tp),
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                iteration=iteration if iteration is not None else original.get("iteration", 0),
                init_method_std=cfg.initializer_range)
    return args


def source_manifest(source: str) -> dict:
    """The conversion.json of directory `source`, or {} when it has none (a run directory, a bare file)."""
    path = os.path.join(source, MANIFEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# --- A recipe continuing the run --------------------------------------------------------------
