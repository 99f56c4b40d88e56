"""Our converted directory: its file names, its model section (model_config.yaml), its manifest's identity, and
our checkpoint files read in either expert layout (OurCheckpoint).

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
from ascend_llm_recipes.models.conversion.stacked import (STACKED, expert_layout, stacked_names, stacked_shapes,
                                                          unstacked_tensors)


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


class OurCheckpoint:
    """One of our checkpoint files (a run's .ckpt, a conversion's .safetensors) read under our per-expert names in
    either expert layout: a MoE layer stacked as MindFormers' MoELayer holds it (stacked.EXPERT_STACKS, a run on Ascend
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
