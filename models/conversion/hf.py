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
(models/shapes.py: names, shapes from the config), with tables.HF_TABLE naming each tensor's transform.
Conversion is strict: every source tensor is converted or named in an ignore list, every shape
is checked against the config before any data is read, unknown tensors are errors, and so is any
NaN or inf value. Output goes through write.write_conversion: built in a hidden sibling directory and
renamed into place when complete, so a failed or interrupted conversion leaves nothing behind.
"""

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.formats import (CkptFile, HFWeights, SafetensorsFile, SafetensorsWriter,
                                                          TorchBinFile)
from ascend_llm_recipes.models.conversion.ours import FORMAT_VERSION, HF_WEIGHTS_FILE, existing_conversion, fingerprint
from ascend_llm_recipes.models.conversion.tables import (IGNORED_HF, IGNORED_OURS, TIED_HEAD, TRANSFORMS, check_tensors,
                                                         tensor_plan)
from ascend_llm_recipes.models.conversion.verify import verify_logits
from ascend_llm_recipes.models.conversion.write import (non_finite_report, progress_bar, refuse_non_finite,
                                                        tensor_sha256, write_conversion, write_ours)


DEFAULT_MAX_SEQ_LENGTH = 4096  # the rotary table and causal mask are seq_length-sized; long contexts opt in


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


def transformers_config(cfg: ModelConfig):
    """Our model_config as a transformers config object: the config.json write_hf writes, for a model in memory."""
    import transformers

    return transformers.AutoConfig.for_model(**hf_config_from_model(cfg))


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
                non_finite += non_finite_report(item.ours, tensor)
                writer.write(item.hf, tensor)
                records.append({"name": item.hf, "source": item.ours, "transform": item.transform,
                                "shape": list(tensor.shape), "sha256": tensor_sha256(tensor)})
                del tensor
                bar.update()
        writer.close()
        refuse_non_finite(non_finite, ckpt_path, "to-hf")
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
