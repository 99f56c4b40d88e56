"""HuggingFace Llama-family checkpoints <-> checkpoints of models/llama.py, tensor by tensor.

    from_hf(HF_DIR, OUT_DIR)  config.json + safetensors / pytorch_model.bin
                              -> OUT_DIR/weights.safetensors (what the MindFormers Trainer loads
                                 through a recipe's `load_checkpoint: OUT_DIR`), model_config.yaml
                                 (the recipe's `model:` section) and conversion.json (the manifest)
    write_hf(CKPT, cfg, OUT_DIR)  one of our .ckpt or .safetensors files -> OUT_DIR/config.json +
                              model.safetensors for transformers (+ tokenizer.model and tokenizer_config.json
                              when given one); training/tools/export.py's to_hf(OURS, OUT_DIR) takes a converted
                              directory, a run directory (its newest verified step) or a file and calls it

How the Trainer reads OUT_DIR (recipe keys `load_checkpoint: OUT_DIR`, `load_ckpt_format:
safetensors`): training/worker/train.py runs MindFormers 1.9 with `use_legacy_format: True`, whose
transform_and_load_checkpoint -> load_checkpoint_with_safetensors loads every `*.safetensors` of a
directory without `rank_N/` folders into every rank ("multi checkpoint file" mode: complete
weights, as data parallel needs), by parameter name. Without use_legacy_format, MindFormers'
newer path (mindformers/checkpoint/checkpoint.py) reads the same directory, but takes one holding
`model.safetensors` for a HuggingFace checkpoint needing a weight template: hence weights.safetensors.

Everything is driven by two tables: CONFIG_MAP (config.json keys <-> model_config fields, with
the options each family must leave at their supported value) and the model's tensor list
(models/shapes.py: names, shapes from the config), with KEY_MAP naming each tensor's transform.
Conversion is strict: every source tensor is converted or named in an ignore list, every shape
is checked against the config before any data is read, unknown tensors are errors, and so is any
NaN or inf value. Output is built in a hidden sibling directory and renamed into place when
complete, so a failed or interrupted conversion leaves nothing behind.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, fields

import numpy as np
import yaml

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.common.schema import load_dataclass, to_plain
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.models.checkpoint_io import CkptFile, SafetensorsFile, SafetensorsWriter, TorchBinFile
from ascend_llm_recipes.models.config import ModelConfig, ModelSection
from ascend_llm_recipes.models.shapes import dimensions, tensor_dimensions

FORMAT_VERSION = 1
CHECKPOINT_FILE = "weights.safetensors"  # not model.safetensors: see the module docstring
MODEL_SECTION_FILE = "model_config.yaml"
MANIFEST_FILE = "conversion.json"
HF_WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_DIR = "optimizer"  # of a conversion: adam_m.safetensors, adam_v.safetensors (weights' names)
MOMENT_FILES = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}  # MindFormers' AdamW state <- torch's
DEFAULT_MAX_SEQ_LENGTH = 4096  # the rotary table and causal mask are seq_length-sized; long contexts opt in
# --verify bounds for float32 weights (bf16 sources are widened exactly). Rounding error grows with the
# logits' magnitude, so max |delta| is bounded relative to the reference's largest |logit| (at least 1).
LOGIT_TOLERANCE = 1e-4
KL_TOLERANCE = 1e-6


# --- Configuration ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """A HuggingFace model_type this converter reads: what it implies and what it must not use."""

    model_type: str
    architecture: str
    qkv_bias: bool
    requirements: tuple  # (config.json key, the only supported value, why)
    defaults: dict       # transformers' class defaults for keys save_pretrained may leave out


COMMON_REQUIREMENTS = (
    ("hidden_act", "silu", "the MLP is SwiGLU with SiLU"),
    ("rope_scaling", None, "rotary positions are unscaled (no linear, dynamic, yarn or llama3 scaling)"),
    ("attention_dropout", 0.0, "the model has no attention dropout"),
)
COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
                   "tie_word_embeddings": False, "pad_token_id": None, "hidden_act": "silu", "rope_scaling": None,
                   "attention_dropout": 0.0}

FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", qkv_bias=False, requirements=(
        ("attention_bias", False, "it biases o_proj as well as q/k/v; the model has q/k/v bias only"),
        ("mlp_bias", False, "the MLP has no biases"),
    ), defaults={**COMMON_DEFAULTS, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
                 "attention_bias": False, "mlp_bias": False}),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, requirements=(
        ("use_sliding_window", False, "attention is full causal attention, never a sliding window"),
    ), defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
                 "num_key_value_heads": 32, "use_sliding_window": False}),
    # Mistral 7B v0.2/v0.3 (sliding_window null) are Llama's decoder under another model_type; v0.1's
    # window of 4096 equals full attention only up to 4096 tokens, and transformers' default is that window.
    "mistral": Family("mistral", "MistralForCausalLM", qkv_bias=False, requirements=(
        ("sliding_window", None, "attention is full causal attention; a sliding window lets each token see only "
                                 "the last sliding_window tokens"),
    ), defaults={**COMMON_DEFAULTS, "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2,
                 "num_key_value_heads": 8, "sliding_window": 4096}),
}

# model_config field <-> config.json key. seq_length and qkv_bias are derived (see below).
CONFIG_MAP = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("intermediate_size", "intermediate_size"),
    ("rms_norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"),
    ("initializer_range", "initializer_range"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "pad_token_id"),
)
# model_config fields a checkpoint's weights depend on: a recipe loading them must agree on each.
# seq_length, token ids, document_attention, initializer_range and compute_dtype are training choices.
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qkv_bias", "vocab_pad_multiple")
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
NO_TOKEN = -1  # a token id HF leaves unset (null); no label equals it, so nothing is masked


def family_of(hf_config: dict, where: str) -> Family:
    """Dispatch on config.json's model_type; anything else is refused by name."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(f"{where}: model_type {model_type!r} (architectures "
                              f"{hf_config.get('architectures')}) is not supported; supported: "
                              f"{', '.join(FAMILIES)}",
                              hint="only Llama-style decoders convert: RMSNorm, rotary positions, SwiGLU, "
                                   "optional q/k/v bias")
    return FAMILIES[model_type]


def model_config_from_hf(hf_config: dict, where: str, seq_length: int = None) -> ModelConfig:
    """config.json -> our model_config, refusing every option the model does not implement."""
    family = family_of(hf_config, where)
    hf = {**family.defaults, **hf_config}
    problems = [f"{key}: missing" for key in REQUIRED_HF_KEYS if key not in hf]
    problems += [f"{key}: {hf[key]!r} is not a positive integer" for key in
                 REQUIRED_HF_KEYS + ("num_key_value_heads", "max_position_embeddings")
                 if key in hf and hf[key] is not None and (type(hf[key]) is not int or hf[key] < 1)]
    problems += [f"{key}: {hf[key]!r} is not a positive number" for key in ("rms_norm_eps", "rope_theta")
                 if type(hf[key]) not in (int, float) or not hf[key] > 0]
    if problems:
        raise ConversionError(f"{where}: {'; '.join(problems)}")
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    for key, supported, why in COMMON_REQUIREMENTS + family.requirements:
        if hf.get(key) != supported:
            problems.append(f"{key}: {hf.get(key)!r} is not supported ({supported!r} only): {why}")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hidden % heads or (hf.get("head_dim") or hidden // heads) != hidden // heads:  # Mistral writes null
        problems.append(f"head_dim: {hf.get('head_dim')!r} with hidden_size {hidden} and {heads} heads is not "
                        "supported: the model uses head_dim = hidden_size / num_attention_heads")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        problems.append(f"layer_types: {sorted(set(hf['layer_types']))} is not supported: every layer must be "
                        "full_attention")
    max_positions = hf["max_position_embeddings"]
    if seq_length is not None and seq_length > max_positions:
        problems.append(f"--seq-length {seq_length} exceeds max_position_embeddings {max_positions}")
    if problems:
        raise ConversionError(f"{where}: {len(problems)} unsupported setting(s):\n" +
                              "\n".join(f"  - {p}" for p in problems))
    values = {ours: hf[theirs] for ours, theirs in CONFIG_MAP}
    for name in TOKEN_ID_FIELDS:
        value = values[name]
        values[name] = NO_TOKEN if value is None else value[0] if isinstance(value, list) else value
    values["seq_length"] = seq_length or min(max_positions, DEFAULT_MAX_SEQ_LENGTH)
    return ModelConfig(**values, qkv_bias=family.qkv_bias)


def hf_config_from_model(cfg: ModelConfig) -> dict:
    """Our model_config -> config.json of the HF family that has exactly its options."""
    family = FAMILIES["qwen2" if cfg.qkv_bias else "llama"]
    config = {"architectures": [family.architecture], "model_type": family.model_type}
    config.update({theirs: getattr(cfg, ours) for ours, theirs in CONFIG_MAP})
    config["num_key_value_heads"] = cfg.kv_heads
    for name in TOKEN_ID_FIELDS:
        config[name] = None if config[name] == NO_TOKEN else config[name]
    config["max_position_embeddings"] = cfg.seq_length
    config.update({key: supported for key, supported, _ in COMMON_REQUIREMENTS + family.requirements})
    config["head_dim"] = cfg.hidden_size // cfg.num_heads
    config["torch_dtype"] = "float32"
    return config


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


# --- The key map ------------------------------------------------------------------------------

# The key map. Our names equal HF's (models/llama.py names its parameters after the HF checkpoint),
# Linear weights are (out, in) on both sides and rotary uses the same half-split layout, so every tensor
# of the model (models/shapes.py TENSORS, with its shape) maps to itself unchanged, except the vocabulary
# tables: they gain padding rows (never predicted) on our side.
KEY_MAP = {"model.embed_tokens.weight": "pad_vocab_rows", "lm_head.weight": "pad_vocab_rows"}  # others: identity

# Source tensors that hold no weights, consumed by being named here: (pattern, kind for the summary).
IGNORED_HF = (
    (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
    (r"model\.rotary_emb\.inv_freq", "rotary frequencies (recomputed from rope_theta)"),
)
IGNORED_OURS = (
    (r"adam_[mv]\..+", "AdamW moments"),
    (r"global_step|epoch_num|step_num|loss_scale|scale_sense|global_batch_size", "training counters"),
    (r"current_iterator_step|last_overflow_iterator_step", "training counters"),
)
TIED_HEAD = "lm_head.weight"  # in a tied HF checkpoint, a copy of the embedding when present at all
TIED_COPY_KIND = "copy of the tied embedding"


def ignored_kinds(names: list) -> dict:
    """{kind: count} of ignored tensor names, for a one-line summary instead of the list."""
    counts: dict = {}
    for name in names:
        kind = next((k for pattern, k in IGNORED_HF + IGNORED_OURS if re.fullmatch(pattern, name)),
                    TIED_COPY_KIND if name == TIED_HEAD else "other")
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def identity(x: np.ndarray, shape: tuple) -> np.ndarray:
    return x


def pad_vocab_rows(x: np.ndarray, shape: tuple) -> np.ndarray:
    """(vocab, hidden) -> (padded_vocab, hidden), zero rows appended (never predicted, never looked up)."""
    if x.shape == shape:  # the usual case (32000, 128256, 151936 rows): no second copy of the largest tensor
        return x
    padded = np.zeros(shape, np.float32)
    padded[:x.shape[0]] = x
    return padded


def strip_vocab_rows(x: np.ndarray, shape: tuple) -> np.ndarray:
    """(padded_vocab, hidden) -> (vocab, hidden)."""
    return np.ascontiguousarray(x[:shape[0]])


TRANSFORMS = {  # name: (HF -> ours, ours -> HF)
    "identity": (identity, identity),
    "pad_vocab_rows": (pad_vocab_rows, strip_vocab_rows),
}


@dataclass(frozen=True)
class TensorPlan:
    hf: str
    ours: str
    hf_shape: tuple
    our_shape: tuple
    transform: str


def tensor_plan(cfg: ModelConfig, tensor_parallel: int = 1) -> list:
    """Every tensor of the model for `cfg` (models/shapes.py order), with both names, shapes and its transform."""
    dims = dimensions(cfg, tensor_parallel)
    plan = []
    for pattern, name, names in tensor_dimensions(cfg):
        hf_shape = tuple(dims[d] for d in names)
        our_shape = tuple(dims["padded_vocab" if d == "vocab" else d] for d in names)
        plan.append(TensorPlan(name, name, hf_shape, our_shape, KEY_MAP.get(pattern, "identity")))
    return plan


def check_tensors(found: dict, expected: dict, ignored: tuple, where: str, extra_ok=()) -> list:
    """Compare tensor name -> shape maps; returns the ignored names, raises listing every problem."""
    problems, skipped = [], []
    for name, shape in found.items():
        if name in expected:
            if tuple(shape) != tuple(expected[name]):
                problems.append(f"{name}: expected shape {tuple(expected[name])} from the config, found "
                                f"{tuple(shape)}")
        elif name in extra_ok or any(re.fullmatch(pattern, name) for pattern, _ in ignored):
            skipped.append(name)
        else:
            problems.append(f"{name}: unknown tensor (not in the key map for this config)")
    problems += [f"{name}: missing" for name in expected if name not in found]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ConversionError(f"{where}: {len(problems)} tensor problem(s):\n" + "\n".join(f"  - {p}" for p in shown),
                              hint="the weights do not match the config (num_hidden_layers, sizes, "
                                   "tie_word_embeddings, bias?)")
    return skipped


# --- HuggingFace weights ----------------------------------------------------------------------

@dataclass
class HFWeights:
    """Where each tensor of a HuggingFace directory lives: name -> (reader, dtype code, shape)."""

    format: str
    files: list
    tensors: dict

    def read(self, name: str) -> np.ndarray:
        return self.tensors[name][0].read(name)


def open_hf_weights(hf_dir: str) -> HFWeights:
    """Index the weight files of hf_dir (safetensors preferred, like transformers), reading headers only."""
    layouts = (("model.safetensors.index.json", "safetensors"), ("model.safetensors", "safetensors"),
               ("pytorch_model.bin.index.json", "bin"), ("pytorch_model.bin", "bin"))
    for name, kind in layouts:
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            break
    else:
        raise ConversionError(f"{hf_dir}: no weights found (looked for {', '.join(n for n, _ in layouts)})")
    opener = SafetensorsFile if kind == "safetensors" else TorchBinFile
    if not name.endswith(".index.json"):
        reader = opener(path)
        return HFWeights(kind, [name], {t: (reader, *info[:2]) for t, info in reader.tensors.items()})
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not an object of tensor name -> shard file name")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConversionError(f"{path}: unreadable index ({type(err).__name__}: {err})") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
    if missing:
        raise ConversionError(f"{hf_dir}: missing shard(s) {', '.join(missing)} listed in {name}",
                              hint="copy every shard the index lists")
    tensors, problems = {}, []
    for shard in shards:
        reader = opener(os.path.join(hf_dir, shard))
        for tensor, info in reader.tensors.items():
            if weight_map.get(tensor) != shard:
                problems.append(f"{shard}: holds {tensor}, which {name} places in {weight_map.get(tensor)}")
            tensors[tensor] = (reader, *info[:2])
    problems += [f"{t}: listed in {name} but absent from {s}" for t, s in weight_map.items() if t not in tensors]
    if problems:
        raise ConversionError(f"{hf_dir}: index and shards disagree:\n" + "\n".join(f"  - {p}" for p in problems))
    return HFWeights(kind, shards, tensors)


def read_hf_config(hf_dir: str) -> tuple:
    """(config dict, sha256 of config.json)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: {'not a directory' if os.path.exists(hf_dir) else 'does not exist'} "
                              "(expected a HuggingFace model directory: config.json + weights)")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir}: no config.json, so not a HuggingFace model directory",
                              hint="pass the directory save_pretrained wrote (config.json + weights)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        config = json.loads(raw)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: cannot read the model config ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: holds a JSON {type(config).__name__}, not a model config object")
    return config, hashlib.sha256(raw).hexdigest()


# --- Output directories -----------------------------------------------------------------------

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


def publish(work_dir: str, out_dir: str, manifest: dict, existing: dict) -> dict:
    """Write the manifest (completion marker) and move work_dir into place; returns the manifest in effect."""
    if existing is not None:
        if existing.get("fingerprint") != manifest["fingerprint"]:
            raise ConversionError(f"output {out_dir} already holds a different model with the same config "
                                  f"(converted from {existing.get('source', {}).get('path')}; tensors differ)",
                                  hint="choose another --output, or remove the old conversion first")
        shutil.rmtree(work_dir)
        return {**existing, "already_converted": True}
    with open(os.path.join(work_dir, MANIFEST_FILE), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty, checked by existing_conversion
    os.rename(work_dir, out_dir)
    return manifest


def io_error(err: OSError, out_dir: str) -> ConversionError:
    return ConversionError(f"{err.filename or out_dir}: {err.strerror or err} while converting into {out_dir}; "
                           "nothing was written", hint="check that the input is readable and that the output's "
                                                       "disk has space, then run the same command again")


def work_dir_for(out_dir: str) -> str:
    """A hidden sibling of out_dir (same file system, so the final rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-", dir=parent)
    except OSError as err:  # a file in the way, a read-only mount, no permission
        raise ConversionError(f"output {out_dir}: cannot create it in {parent} ({err.strerror or err}"
                              + (f": {err.filename}" if err.filename else "") + ")",
                              hint="choose an --output in a writable directory") from None


def progress_bar(total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not show, leave=False)


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


# --- HF -> ours -------------------------------------------------------------------------------

def from_hf(hf_dir: str, out_dir: str, seq_length: int = None, verify: bool = False,
            show_progress: bool = True) -> dict:
    """Convert a HuggingFace directory into OUT_DIR (weights.safetensors, model_config.yaml, conversion.json).

    With verify, logits of transformers and of our model are compared before OUT_DIR is
    published; a conversion outside tolerance leaves no output. Returns the manifest.
    """
    start = time.perf_counter()
    hf_dir = os.path.abspath(hf_dir)
    hf_config, config_sha = read_hf_config(hf_dir)
    where = os.path.join(hf_dir, "config.json")
    cfg = model_config_from_hf(hf_config, where, seq_length)
    weights = open_hf_weights(hf_dir)
    plan = tensor_plan(cfg)
    found = {name: info[2] for name, info in weights.tensors.items()}
    tied_copy = (TIED_HEAD,) if cfg.tie_word_embeddings else ()
    ignored = check_tensors(found, {p.hf: p.hf_shape for p in plan}, IGNORED_HF, hf_dir, extra_ok=tied_copy)
    family = family_of(hf_config, where)
    source = {"path": hf_dir, "model_type": family.model_type, "architectures": hf_config.get("architectures"),
              "config_sha256": config_sha, "format": weights.format,
              "files": [{"file": name, "bytes": os.path.getsize(os.path.join(hf_dir, name))}
                        for name in weights.files]}

    def tokenizer_entries(work_dir: str) -> dict:
        note, files = copy_hf_tokenizer(hf_dir, work_dir, out_dir)
        return {"tokenizer": note, "tokenizer_files": files}

    check = (lambda work_dir: verify_logits(hf_dir, work_dir)) if verify else None
    return write_ours(weights, cfg, out_dir, "from-hf", source, f"Converted from {hf_dir} ({family.model_type})",
                      verify=check, ignored=ignored, show_progress=show_progress, more_files=tokenizer_entries,
                      start=start)


def write_ours(weights: HFWeights, cfg: ModelConfig, out_dir: str, direction: str, source: dict, header: str,
               verify=None, ignored=(), show_progress: bool = True, moments=None, more_files=None, start=None,
               **extra) -> dict:
    """OUT_DIR in our format (weights.safetensors, model_config.yaml, conversion.json) from HF-named `weights`.

    from_hf, megatron.from_megatron and torch_state.from_torch all write through here (and so through
    write_conversion). moments ({"adam_m": HF-named moments, "adam_v": ...}) go to optimizer/adam_m.safetensors
    and adam_v.safetensors under the weights' names; more_files(work_dir) writes further files and returns
    their manifest entries (the tokenizer of from_hf); verify(work_dir) returns the parity result.
    """
    plan = tensor_plan(cfg)
    model = to_plain(cfg)
    existing = existing_conversion(out_dir, model)

    def write_files(work_dir: str) -> dict:
        tensors = write_weights(weights, plan, os.path.join(work_dir, CHECKPOINT_FILE), show_progress,
                                source["path"], direction)
        if TIED_HEAD in ignored:
            check_tied_copy(weights, tensors)
        for prefix, values in (moments or {}).items():
            os.makedirs(os.path.join(work_dir, OPTIMIZER_DIR), exist_ok=True)
            write_weights(values, plan, os.path.join(work_dir, OPTIMIZER_DIR, f"{prefix}.safetensors"),
                          show_progress, f"{source['path']} ({MOMENT_FILES[prefix]})", direction)
        with open(os.path.join(work_dir, MODEL_SECTION_FILE), "w", encoding="utf-8") as f:
            f.write(model_section_yaml(cfg, f"{header} by scripts/convert_checkpoint.py.\n{recipe_keys(out_dir)}"))
        manifest = {"format_version": FORMAT_VERSION, "direction": direction,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": source,
                    "checkpoint": CHECKPOINT_FILE, "dtype": "float32", "model": model,
                    "padded_vocab_size": dimensions(cfg)["padded_vocab"], "tensors": tensors,
                    "ignored": list(ignored), "fingerprint": fingerprint(model, tensors), **extra}
        if more_files is not None:
            manifest.update(more_files(work_dir))
        return manifest

    return write_conversion(out_dir, write_files, existing, verify=verify, start=start)


def write_conversion(out_dir: str, write_files, existing: dict = None, verify=None, start: float = None) -> dict:
    """The one way a conversion reaches OUT_DIR: built in a hidden sibling, checked, then renamed into place.

    write_files(work_dir) writes the files and returns the manifest; verify(work_dir), when given, returns
    the parity result (or raises) before anything is published; `existing` is existing_conversion(out_dir, ...)
    (None for a free OUT_DIR). Any OSError (a full disk, an unreadable input, a vanished output) becomes a
    ConversionError naming the file, and a failed conversion leaves nothing behind. Returns the manifest.
    """
    start = time.perf_counter() if start is None else start
    work_dir = work_dir_for(out_dir)
    try:
        manifest = write_files(work_dir)
        if verify is not None:
            manifest["verify"] = verify(work_dir)
        manifest["seconds"] = round(time.perf_counter() - start, 2)
        published = publish(work_dir, out_dir, manifest, existing)
        return {**published, "verify": manifest["verify"]} if verify is not None else published
    except OSError as err:
        raise io_error(err, out_dir) from None
    finally:
        if os.path.isdir(work_dir):
            shutil.rmtree(work_dir)


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def copy_hf_tokenizer(hf_dir: str, work_dir: str, out_dir: str) -> tuple:
    """Copy the source's tokenizer files beside the weights, so `prepare_data.py --tokenizer OUT_DIR` uses them.

    Returns (a note for the summary, [{file, sha256}]).
    """
    files = []
    for name in HF_TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(work_dir, name))
            files.append({"file": name, "sha256": file_sha256(os.path.join(work_dir, name))})
    if not files:
        return f"not copied: {hf_dir} holds no tokenizer file ({', '.join(HF_TOKENIZER_FILES[:2])})", []
    return (f"copied from {hf_dir} ({', '.join(f['file'] for f in files)}): prepare data for this model with "
            f"scripts/prepare_data.py --tokenizer {os.path.abspath(out_dir)}"), files


def write_weights(weights: HFWeights, plan: list, path: str, show_progress: bool, where: str,
                  direction: str) -> list:
    """Our safetensors file of `weights` (HF-named) along `plan`, one tensor at a time; returns the records."""
    # MindSpore's save_checkpoint(format="safetensors") marks its files the same way.
    writer = SafetensorsWriter(path, {p.ours: p.our_shape for p in plan}, metadata={"format": "ms"})
    records, non_finite = [], []
    with progress_bar(len(plan), "convert", show_progress) as bar:
        for item in plan:
            source = weights.read(item.hf)
            tensor = TRANSFORMS[item.transform][0](source, item.our_shape)
            non_finite += _non_finite(item.hf, tensor)
            writer.write(item.ours, tensor)
            records.append({"name": item.ours, "source": item.hf, "source_dtype": weights.tensors[item.hf][1],
                            "transform": item.transform, "shape": list(tensor.shape), "sha256": _sha256(tensor)})
            del source, tensor  # keep one tensor alive at a time
            bar.update()
    writer.close()
    _refuse_non_finite(non_finite, where, direction)
    return records


def check_tied_copy(weights: HFWeights, records: list) -> None:
    """A tied checkpoint that stores lm_head.weight must store the embedding again, nothing else."""
    embedding = next(r for r in records if r["source"] == "model.embed_tokens.weight")
    head = pad_vocab_rows(weights.read(TIED_HEAD), tuple(embedding["shape"]))
    if _sha256(head) != embedding["sha256"]:
        raise ConversionError(f"{TIED_HEAD}: differs from model.embed_tokens.weight although config.json sets "
                              "tie_word_embeddings: true",
                              hint="set tie_word_embeddings: false if the head is a separate matrix")


# --- ours -> HF -------------------------------------------------------------------------------

def architecture_differences(recorded: ModelConfig, wanted: ModelConfig) -> list:
    """'key: checkpoint X, recipe Y' for every architecture field that differs (training choices may differ)."""
    def value(cfg, name):
        return cfg.kv_heads if name == "num_kv_heads" else getattr(cfg, name)

    return [f"model.model_config.{name}: checkpoint {value(recorded, name)!r}, recipe {value(wanted, name)!r}"
            for name in ARCHITECTURE_FIELDS if value(recorded, name) != value(wanted, name)]


def write_hf(ckpt_path: str, cfg: ModelConfig, out_dir: str, tensor_parallel: int = 1, source: dict = None,
             tokenizer: tuple = None, tokenizer_note: str = None, show_progress: bool = True) -> dict:
    """Convert one of our checkpoint files to OUT_DIR/config.json + model.safetensors (float32).

    `source` is recorded in the manifest; `tokenizer` (file, its dataset manifest entry) is copied beside
    the weights. training/tools/export.py's to_hf finds these for a run or converted directory. Returns the manifest.
    """
    start = time.perf_counter()
    ckpt = CkptFile(ckpt_path) if ckpt_path.endswith(".ckpt") else SafetensorsFile(ckpt_path)
    plan = tensor_plan(cfg, tensor_parallel)
    found = {name: info[1] for name, info in ckpt.tensors.items()}
    ignored = check_tensors(found, {p.ours: p.our_shape for p in plan}, IGNORED_OURS, ckpt_path)
    hf_config = hf_config_from_model(cfg)
    existing = existing_conversion(out_dir, hf_config)

    def write_files(work_dir: str) -> dict:
        writer = SafetensorsWriter(os.path.join(work_dir, HF_WEIGHTS_FILE), {p.hf: p.hf_shape for p in plan},
                                   metadata={"format": "pt"})  # transformers refuses files without it
        records, non_finite = [], []
        with progress_bar(len(plan), "convert", show_progress) as bar:
            for item in plan:
                tensor = TRANSFORMS[item.transform][1](ckpt.read(item.ours), item.hf_shape)
                non_finite += _non_finite(item.ours, tensor)
                writer.write(item.hf, tensor)
                records.append({"name": item.hf, "source": item.ours, "transform": item.transform,
                                "shape": list(tensor.shape), "sha256": _sha256(tensor)})
                del tensor
                bar.update()
        writer.close()
        _refuse_non_finite(non_finite, ckpt_path, "to-hf")
        with open(os.path.join(work_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        if tokenizer:
            write_hf_tokenizer(tokenizer, work_dir)
        return {
            "format_version": FORMAT_VERSION,
            "direction": "to-hf",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source": source or {"path": ckpt_path},
            "checkpoint": HF_WEIGHTS_FILE,
            "dtype": "float32",
            "model": hf_config,
            "tensors": records,
            "ignored": ignored,
            "tokenizer": tokenizer_note,
            "fingerprint": fingerprint(hf_config, records),
        }

    return write_conversion(out_dir, write_files, existing, start=start)


def _non_finite(name: str, tensor: np.ndarray) -> list:
    """['name (N NaN, M inf)'] when the tensor holds non-finite values, else []."""
    if np.isfinite(tensor).all():
        return []
    nan = int(np.isnan(tensor).sum())
    return [f"{name} ({nan} NaN, {int(tensor.size - np.isfinite(tensor).sum()) - nan} inf)"]


# What to do about a NaN or inf weight depends on where it came from (the conversion's direction).
NON_FINITE_HINTS = {
    "from-hf": "the HuggingFace checkpoint itself holds them: download it again (a damaged copy) or convert "
               "another revision of the model",
    "from-megatron": "the Megatron checkpoint itself holds them: convert an earlier iteration (--iteration N)",
    "from-torch": "the state dict itself holds them: convert one saved before the weights diverged",
    "to-hf": "export an earlier checkpoint (name its .ckpt file, or give the run directory for its newest "
             "verified step)",
}


def _refuse_non_finite(problems: list, where: str, direction: str) -> None:
    if problems:
        raise ConversionError(f"{where}: non-finite values in {len(problems)} tensor(s): {', '.join(problems[:10])}"
                              + (f" and {len(problems) - 10} more" if len(problems) > 10 else "")
                              + "; nothing was written",
                              hint=f"{NON_FINITE_HINTS[direction]}; a NaN or inf weight makes every prediction NaN")


HF_TOKENIZER_CONFIG = {  # what transformers' LlamaTokenizer needs for data/tokenizer.py's sentencepiece models
    "tokenizer_class": "LlamaTokenizer",
    "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
    "add_bos_token": False, "add_eos_token": False,  # the packed data holds documents + EOD, no BOS
    "legacy": True,  # encode exactly as sentencepiece does, like data preparation
}


def write_hf_tokenizer(tokenizer: tuple, out_dir: str) -> None:
    """The dataset's tokenizer (path, manifest entry) under its own kind's name, with a tokenizer_config.json."""
    path, entry = tokenizer
    if path.endswith(".json"):  # an HF tokenizer: transformers reads it as it is; name its end-of-text token
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": entry.get("eod_token")}
    else:
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.model"))
        config = dict(HF_TOKENIZER_CONFIG)
        if entry.get("pad_id", 0) < 0:  # no pad piece (Llama 2's layout): transformers would add one
            config["pad_token"] = None
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


# --- Parity -----------------------------------------------------------------------------------

def load_our_model(converted_dir: str):
    """Our LlamaForCausalLM with a converted checkpoint loaded strictly (every parameter, nothing else)."""
    if "LOCAL_DEFAULT_PATH" not in os.environ:  # MindFormers logs to ./output from import time on otherwise
        os.environ["LOCAL_DEFAULT_PATH"] = tempfile.mkdtemp(prefix="mindformers-log-")
    import mindspore as ms
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = read_model_file(os.path.join(converted_dir, MODEL_SECTION_FILE))
    if ms.get_context("device_target") != "CPU":  # compared with transformers on the CPU
        ms.set_device("CPU")
    net = LlamaForCausalLM(LlamaConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "type"}))
    params = ms.load_checkpoint(os.path.join(converted_dir, CHECKPOINT_FILE), format="safetensors")
    not_loaded, unused = ms.load_param_into_net(net, params, strict_load=True)
    if not_loaded or unused:
        raise ConversionError(f"{converted_dir}: checkpoint and model disagree: parameters not loaded "
                              f"{not_loaded}, checkpoint entries unused {unused}")
    return net, cfg


def verify_logits(hf_dir: str, converted_dir: str, batch: int = 2, max_tokens: int = 128, seed: int = 0) -> dict:
    """Logits of transformers (float32, CPU) and of our model on the same random tokens.

    Returns max |delta logits| and the mean over positions of KL(hf || ours); raises when
    either exceeds its tolerance.
    """
    return verify_against(lambda tokens: reference_logits(hf_dir, tokens), converted_dir, hf_dir, batch=batch,
                          max_tokens=max_tokens, seed=seed)


def verify_against(reference, converted_dir: str, where: str, name: str = "transformers",
                   hint: str = "nothing was written; report the model's config.json", batch: int = 2,
                   max_tokens: int = 128, seed: int = 0, label: str = None) -> dict:
    """Our logits against reference(tokens) -> (B, S, vocab) logits on random tokens; raises outside PARITY_RULE.

    The one parity check of every direction: transformers for from_hf (verify_logits), a pure-torch
    forward for Meta's layout and for Megatron's (megatron.py). `name` is recorded in the manifest,
    `label` (default: name) is what the error says the logits differ from.
    """
    import mindspore as ms

    net, cfg = load_our_model(converted_dir)
    length = min(cfg.seq_length, max_tokens)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, length))
    ours = net.logits(ms.Tensor(tokens.astype(np.int32))).asnumpy().astype(np.float64)[..., :cfg.vocab_size]
    del net
    result = compare_logits(reference(tokens), ours)
    result.update(batch=batch, tokens=length, reference=name)
    check_parity(result, where, reference=label or (name if name != "transformers" else "transformers'"), hint=hint)
    return result


def reference_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 CPU logits (float64) of an HF directory on `tokens` (B, S): the parity reference."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return reference.eval()(torch.from_numpy(tokens)).logits.double().numpy()


def compare_logits(reference: np.ndarray, ours: np.ndarray) -> dict:
    """max |delta|, its tolerance (relative to the reference's largest |logit|) and mean KL(reference || ours)."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(reference), log_softmax(ours)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    scale = float(np.abs(reference).max())
    return {"max_abs_delta": float(np.abs(reference - ours).max()), "logit_scale": scale,
            "max_abs_tolerance": LOGIT_TOLERANCE * max(1.0, scale), "kl": kl}


PARITY_RULE = (f"max |delta| <= {LOGIT_TOLERANCE:g} x max(1, largest |logit|), "
               f"KL(hf || ours) <= {KL_TOLERANCE:g}")


def check_parity(result: dict, where: str, reference: str = "transformers'",
                 hint: str = "nothing was written; report the model's config.json") -> None:
    """Refuse logits outside PARITY_RULE (float32 rounding scales with the logits; a wrong tensor does not)."""
    if not (result["max_abs_delta"] <= result["max_abs_tolerance"] and result["kl"] <= KL_TOLERANCE):
        raise ConversionError(f"{where}: converted logits differ from {reference}: max |delta| "
                              f"{result['max_abs_delta']:.3e} (tolerance {result['max_abs_tolerance']:.2e} = "
                              f"{LOGIT_TOLERANCE:g} x largest |logit| {result['logit_scale']:.3g}, at least "
                              f"{LOGIT_TOLERANCE:g}), KL(reference || ours) {result['kl']:.3e} "
                              f"(tolerance {KL_TOLERANCE:.0e})",
                              hint=hint)


def summary(manifest: dict, out_dir: str) -> str:
    """One paragraph for the end of a conversion."""
    count = sum(int(np.prod(t["shape"])) for t in manifest["tensors"])
    text = (f"{'already converted' if manifest.get('already_converted') else 'converted'}: "
            f"{len(manifest['tensors'])} tensors ({count:,} values, float32) from {manifest['source']['path']} "
            f"into {os.path.abspath(out_dir)}/{manifest['checkpoint']}")
    if manifest.get("seconds") is not None and not manifest.get("already_converted"):
        text += f" in {manifest['seconds']:.1f} s"
    source = manifest["source"]
    if source.get("step") is not None:
        text += f"; step {source['step']}, the run's newest verified checkpoint"
    if source.get("skipped"):
        text += f" (newer ones skipped: {'; '.join(source['skipped'])})"
    if manifest["ignored"]:
        kinds = ", ".join(f"{count} {kind}" for kind, count in ignored_kinds(manifest["ignored"]).items())
        text += f"; ignored {len(manifest['ignored'])} tensors that are not weights ({kinds}; named in {MANIFEST_FILE})"
    if manifest.get("tokenizer"):
        text += f"; tokenizer {manifest['tokenizer']}"
    if manifest["direction"].startswith("from-"):
        text += f". {recipe_keys(out_dir)}"
    if "verify" in manifest:
        v = manifest["verify"]
        reference = v.get("reference", "transformers")
        text += (f". Parity with {reference} on {v['batch']}x{v['tokens']} random tokens: max |delta logits| "
                 f"{v['max_abs_delta']:.2e} (largest |logit| {v['logit_scale']:.3g}), KL(reference || ours) "
                 f"{v['kl']:.2e}")
        if reference == "transformers":
            text += f"; passes {PARITY_RULE}"
    return text + "."
