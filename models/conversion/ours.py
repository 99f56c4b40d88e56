"""Our converted directory: its file names, its model section (model_config.yaml), its manifest's identity, and
our checkpoint files in either expert layout: MoE layers per expert (our CPU model's, Hugging Face's names) or
stacked as MindFormers 1.9's MoELayer holds them (models/expert_parallel.py, what a MoE recipe runs on Ascend).
`scripts/convert_checkpoint.py --expert-layout stacked` writes the latter (write.py); --verify, --to-hf and
--to-megatron read either (verify.py, OurCheckpoint) and the worker's load check expects the one the recipe runs
(training/worker/train.py). One table, EXPERT_STACKS, and what applies it to tensors (stacked_tensor,
unstacked_tensors; on dicts stack_moe_layers, unstack_moe_layers) and to shapes (stacked_shapes, tested against the
arrays and MindFormers' real cells).

Every conversion into our format writes OUT_DIR/weights.safetensors, model_config.yaml (a recipe's `model:`
section) and conversion.json (the manifest, written last: the completion marker); see hf.py for why
weights.safetensors and not model.safetensors.
"""

import hashlib
import json
import os

import numpy as np
import yaml

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.common.schema import load_dataclass, to_plain
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.config import ModelConfig, ModelSection
from ascend_llm_recipes.models.conversion.formats import CkptFile, SafetensorsFile
from ascend_llm_recipes.models.conversion.tables import one_expert, stack_experts, template_of
from ascend_llm_recipes.models.shapes import TENSORS, tensor_flags


FORMAT_VERSION = 1
CHECKPOINT_FILE = "weights.safetensors"  # not model.safetensors: see hf.py's docstring
MODEL_SECTION_FILE = "model_config.yaml"
MANIFEST_FILE = "conversion.json"
HF_WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_DIR = "optimizer"  # of a conversion: adam_m.safetensors, adam_v.safetensors (weights' names)
MOMENT_FILES = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}  # MindFormers' AdamW state <- torch's
# model_config fields a checkpoint's weights depend on: a recipe loading them must agree on each.
# seq_length, token ids, document_attention, initializer_range and compute_dtype are training choices.
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qkv_bias", "vocab_pad_multiple",
                       "head_dim", "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                       "norm_topk_prob", "shared_expert_intermediate_size", "shared_expert_gate", "dense_layers",
                       "router_score", "n_group", "topk_group", "routed_scaling_factor", "expert_bias",
                       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# (not compared: training choices such as seq_length, dtypes, kernels, token ids and the router loss coefficients)


def model_section_yaml(cfg: ModelConfig, header: str) -> str:
    """A recipe's `model:` section for `cfg`, in the recipe vocabulary."""
    section = {"model": {"model_config": {"type": LLAMA_CONFIG_TYPE, **to_plain(cfg)},
                         "arch": {"type": LLAMA_MODEL_TYPE}}}
    for choice in ("compute_dtype", "param_dtype"):  # training choices, the recipe's to make
        section["model"]["model_config"].pop(choice, None)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(section, sort_keys=False)


def recipe_keys(out_dir: str) -> str:
    """How a recipe trains from a converted directory."""
    out_dir = os.path.abspath(out_dir)
    return (f"To train from it, use this model: section ({os.path.join(out_dir, MODEL_SECTION_FILE)}) in the "
            f"recipe and set load_checkpoint: {out_dir} and load_ckpt_format: safetensors")


def read_model_yaml(path: str) -> dict:
    """A YAML mapping with a `model:` section (a model_config.yaml, or a whole recipe), as read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise ConversionError(f"{path}: cannot read the model section ({err})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ConversionError(f"{path}: no `model:` section")
    return data


def read_model_file(path: str) -> ModelConfig:
    """The model configuration of a model_config.yaml (a recipe's `model:` section and nothing else)."""
    return model_section(read_model_yaml(path), path)


def model_section(data: dict, path: str) -> ModelConfig:
    """The ModelConfig of a {"model": ...} mapping read from `path`, strictly (every problem named)."""
    problems: list = []
    section = load_dataclass(ModelSection, data["model"], "model", problems)
    if problems:
        raise ConversionError(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return section.model_config


# What a conversion from HuggingFace keeps of its source in conversion.json's "source" (hf.py from_hf), so that
# --to-hf writes back the source's context length, the config.json keys our model does not read and its
# generation_config.json (hf_families.export_config)
SOURCE_CONFIG, SOURCE_GENERATION_CONFIG = "hf_config", "generation_config"


def hf_source(converted_dir: str) -> dict:
    """{"path", "config", "generation_config"} of the HuggingFace directory `converted_dir` was converted from, as
    its conversion.json recorded them; None when it records none (not a conversion, or from Megatron-LM, Meta's
    files or a state dict without a config.json)."""
    source = source_manifest(converted_dir).get("source") or {}
    if not isinstance(source.get(SOURCE_CONFIG), dict):
        return None
    return {"path": source.get("path"), "config": source[SOURCE_CONFIG],
            "generation_config": source.get(SOURCE_GENERATION_CONFIG)}


def source_manifest(source: str) -> dict:
    """The conversion.json of directory `source`, or {} when it has none (a run directory, a bare file)."""
    path = os.path.join(source, MANIFEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def fingerprint(model: dict, tensors: list) -> str:
    """Identity of a converted model: its config and the sha256 of every tensor."""
    content = json.dumps({"model": model, "tensors": [[t["name"], t["shape"], t["sha256"]] for t in tensors]},
                         sort_keys=True)
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


def existing_conversion(out_dir: str, model: dict) -> dict:
    """The manifest already in out_dir when it holds this model's conversion; None when out_dir is free.

    Refuses a file, a directory with other content, and a conversion of a different model.
    """
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        raise ConversionError(f"output {out_dir} is a file, not a directory")
    if not os.listdir(out_dir):
        return None
    try:
        with open(os.path.join(out_dir, MANIFEST_FILE), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        raise ConversionError(f"output {out_dir} already holds files that are not a conversion "
                              f"(no readable {MANIFEST_FILE})", hint="choose another --output") from None
    if manifest.get("model") != model:
        raise ConversionError(f"output {out_dir} already holds a different model (converted from "
                              f"{manifest.get('source', {}).get('path')})",
                              hint="choose another --output, or remove the old conversion first")
    return manifest


def architecture_differences(recorded: ModelConfig, wanted: ModelConfig) -> list:
    """'key: checkpoint X, recipe Y' for every architecture field that differs (training choices may differ)."""
    resolved = {"num_kv_heads": "kv_heads", "head_dim": "head_size", "moe_intermediate_size": "expert_size"}

    def value(cfg, name):  # an unset value and its default spelled out are the same architecture
        return getattr(cfg, resolved.get(name, name))

    return [f"model.model_config.{name}: checkpoint {value(recorded, name)!r}, recipe {value(wanted, name)!r}"
            for name in ARCHITECTURE_FIELDS if value(recorded, name) != value(wanted, name)]


# MindFormers 1.9's MoELayer holds a MoE layer in these tensors, as its converters write them from Hugging Face's
# (mindformers/checkpoint/converter/convert_op.py: ExpertsConvertOp 259-283, ConcatConvertOp 186-225, which
# tests/test_expert_parallel.py runs as the reference): {its tensor ({n} a layer): (how, our tensors it holds)}.
# "experts": as GroupedMLP holds weight2 (stack_experts, hidden axis last), expert e's weight (gate and up fused as
# [gate; up]) transposed to (in, out) in rows e*in..: weight1 (E*hidden, 2F) is GroupedMLP's weight1's memory shaped
# (E*hidden, 2F), weight2 (E*F, hidden) GroupedMLP's own. "interleave": the parts' rows alternating, as its
# SharedExpertMLPInterleaved reads gate and up (transformer/mlp.py:210-225; one tensor-parallel rank). "rename".
EXPERT_STACKS = {
    "model.layers.{n}.mlp.router.weight": ("rename", ("model.layers.{n}.mlp.gate.weight",)),
    "model.layers.{n}.mlp.experts.weight1": ("experts", ("model.layers.{n}.mlp.experts.{e}.gate_proj.weight",
                                                         "model.layers.{n}.mlp.experts.{e}.up_proj.weight")),
    "model.layers.{n}.mlp.experts.weight2": ("experts", ("model.layers.{n}.mlp.experts.{e}.down_proj.weight",)),
    "model.layers.{n}.mlp.shared_experts.linear_fc1.weight": (
        "interleave", ("model.layers.{n}.mlp.shared_expert.gate_proj.weight",
                       "model.layers.{n}.mlp.shared_expert.up_proj.weight")),
    "model.layers.{n}.mlp.shared_experts.linear_fc2.weight": (
        "rename", ("model.layers.{n}.mlp.shared_expert.down_proj.weight",)),
    "model.layers.{n}.mlp.shared_experts.shared_experts_gate.weight": (
        "rename", ("model.layers.{n}.mlp.shared_expert_gate.weight",)),
}
PER_EXPERT, STACKED = "per-expert", "stacked"  # our CPU model's (Hugging Face's names), MindFormers' MoELayer's


def stacked_names(cfg) -> dict:
    """{stacked tensor: [our tensors it holds, expert by expert]} of every MoE layer of cfg."""
    flag_of = {pattern: flag for pattern, _, flag in TENSORS}
    out = {}
    for n in range(cfg.num_layers):
        flags = tensor_flags(cfg, n)
        for stack, (how, parts) in EXPERT_STACKS.items():
            if flags[flag_of[parts[0]]]:  # the layer has them (a MoE layer; its shared expert, gate)
                out[stack.format(n=n)] = [part.format(n=n, e=e) for e in
                                          (range(cfg.num_experts) if how == "experts" else [None]) for part in parts]
    return out


def stacked_tensor(name: str, read, cfg) -> np.ndarray:
    """The stacked tensor `name` of one layer from our tensors, read(our name): that layer's experts in memory."""
    template, numbers = template_of(name)
    how, parts = EXPERT_STACKS[template]
    if how == "rename":
        return read(parts[0].format(**numbers))
    if how == "interleave":  # (rows, in) each -> (rows, parts, in) -> (parts x rows, in)
        pieces = [read(part.format(**numbers)) for part in parts]
        return np.stack(pieces, 1).reshape(-1, pieces[0].shape[1])
    return stack_experts([np.concatenate([read(part.format(e=e, **numbers)) for part in parts])
                          for e in range(cfg.num_experts)], hidden_axis=1)


def unstacked_tensors(name: str, tensor: np.ndarray, cfg) -> dict:
    """stacked_tensor backwards: {our name: a view of `tensor`}."""
    template, numbers = template_of(name)
    how, parts = EXPERT_STACKS[template]
    if how == "rename":
        return {parts[0].format(**numbers): tensor}
    if how == "interleave":
        rows = tensor.reshape(-1, len(parts), tensor.shape[1])
        return {part.format(**numbers): rows[:, i] for i, part in enumerate(parts)}
    return {part.format(e=e, **numbers): piece for e in range(cfg.num_experts)
            for part, piece in zip(parts, np.split(one_expert(tensor, cfg.num_experts, e, hidden_axis=1), len(parts)))}


def stack_moe_layers(tensors: dict, cfg) -> dict:
    """`tensors` (numpy, by our name) with every MoE layer in MindFormers' MoELayer's tensors (EXPERT_STACKS)."""
    out = dict(tensors)
    for name in stacked_names(cfg):
        out[name] = stacked_tensor(name, out.pop, cfg)
    return out


def unstack_moe_layers(tensors: dict, cfg) -> dict:
    """stack_moe_layers backwards."""
    out = dict(tensors)
    for name in stacked_names(cfg):
        out.update({part: np.ascontiguousarray(value)
                    for part, value in unstacked_tensors(name, out.pop(name), cfg).items()})
    return out


def stacked_shapes(shapes: dict, cfg) -> dict:
    """{name: shape} of our tensors (models/shapes.py parameter_shapes) in the stacked layout: each MoE layer's
    stacked tensors where their first part stood (stack_moe_layers's names and shapes, without data)."""
    owner = {part: stack for stack, parts in stacked_names(cfg).items() for part in parts}
    out = {}
    for name, shape in shapes.items():
        stack = owner.get(name)
        if stack is None:
            out[name] = tuple(shape)
            continue
        if stack in out:  # a later part of a stack already placed
            continue
        how, parts = EXPERT_STACKS[template_of(stack)[0]]
        out[stack] = {"rename": tuple(shape), "interleave": (len(parts) * shape[0], shape[1]),
                      "experts": (cfg.num_experts * shape[1], len(parts) * shape[0])}[how]
    return out


def expert_layout(names, cfg) -> str:
    """The expert layout of a checkpoint holding tensors `names`: STACKED when any MoE layer is stacked."""
    return STACKED if cfg.moe and not set(stacked_names(cfg)).isdisjoint(names) else PER_EXPERT


class OurCheckpoint:
    """One of our checkpoint files (a run's .ckpt, a conversion's .safetensors) read under our per-expert names in
    either expert layout: a MoE layer stacked as MindFormers' MoELayer holds it (EXPERT_STACKS, a run on Ascend
    or --expert-layout stacked) is split on read, one stacked tensor held at a time.

    `tensors`: the file's own entries, {name: (dtype, shape, ...)}; `layout`: tables.PER_EXPERT or STACKED.
    """

    def __init__(self, path: str, cfg: ModelConfig):
        self.path, self.cfg = path, cfg
        self.file = CkptFile(path) if path.endswith(".ckpt") else SafetensorsFile(path)
        self.tensors = self.file.tensors
        self.layout = expert_layout(self.tensors, cfg)
        self.stack_of = ({part: stack for stack, parts in stacked_names(cfg).items() for part in parts}
                         if self.layout == STACKED else {})
        self.held = (None, {})

    def expected(self, shapes: dict) -> dict:
        """Our {name: shape} (models/shapes.py parameter_shapes) under the names and shapes this file holds them."""
        return stacked_shapes(shapes, self.cfg) if self.stack_of else shapes

    def __contains__(self, name: str) -> bool:
        return self.stack_of.get(name, name) in self.tensors

    def read(self, name: str) -> np.ndarray:
        """Our tensor `name` as float32."""
        stack = self.stack_of.get(name)
        if stack is None:
            return self.file.read(name)
        if self.held[0] != stack:
            self.held = (None, {})  # the previous stacked tensor goes before the next is read
            self.held = (stack, unstacked_tensors(stack, self.file.read(stack), self.cfg))
        return np.ascontiguousarray(self.held[1][name])
