"""HuggingFace checkpoints (hf_families.py: Llama, Mistral, Qwen2/3, Qwen2/3-MoE, Mixtral, DeepSeek-V3) <-> ours.

    from_hf(HF_DIR, OUT_DIR)  config.json + safetensors / pytorch_model.bin
                              -> OUT_DIR/weights.safetensors (what the MindFormers Trainer loads
                                 through a recipe's `load_checkpoint: OUT_DIR`), model_config.yaml
                                 (the recipe's `model:` section) and conversion.json (the manifest)
    write_hf(CKPT, cfg, OUT_DIR)  one of our .ckpt or .safetensors files (either expert layout, ours.OurCheckpoint)
                              -> OUT_DIR/config.json + model.safetensors for transformers (+ tokenizer.model
                              and tokenizer_config.json when given one; for weights converted from HuggingFace,
                              the source's config.json keys our model does not decide, such as its context
                              length, and its generation_config.json, which from_hf keeps in conversion.json:
                              hf_families.export_config); training/tools/export.py's
                              to_hf(OURS, OUT_DIR) takes a converted directory, a run directory (its newest
                              verified step) or a file and calls it

How the Trainer reads OUT_DIR (recipe keys `load_checkpoint: OUT_DIR`, `load_ckpt_format:
safetensors`): training/worker/train.py runs MindFormers 1.9 with `use_legacy_format: True`, whose
transform_and_load_checkpoint -> load_checkpoint_with_safetensors loads every `*.safetensors` of a
directory without `rank_N/` folders into every rank ("multi checkpoint file" mode: complete
weights, as data parallel needs), by parameter name. Without use_legacy_format, MindFormers'
newer path (mindformers/checkpoint/checkpoint.py) reads the same directory, but takes one holding
`model.safetensors` for a HuggingFace checkpoint needing a weight template: hence weights.safetensors.

Everything is driven by tables: hf_families.py's FAMILIES and CONFIG_MAP (config.json keys <-> model_config
fields, with the options each family must leave at their supported value) and the model's tensor list
(models/shapes.py: names, shapes from the config), with the family's table (tables.HF_TABLE, MIXTRAL_TABLE, or
DeepSeek-V3's by its config.json's rope_interleave) naming each tensor and its transform.
Conversion is strict: every source tensor is converted or named in an ignore list, every shape
is checked against the config before any data is read, unknown tensors are errors, and so is any
NaN or inf value. Output goes through write.write_conversion: built in a hidden sibling directory and
renamed into place when complete, so a failed or interrupted conversion leaves nothing behind.
"""

import hashlib
import json
import os
import re
import shutil
import time

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.common.files import file_sha256
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.formats import (HFWeights, SafetensorsFile, SafetensorsWriter,
                                                          TorchBinFile)
from ascend_llm_recipes.models.conversion.hf_families import (ROPE_INTERLEAVE, conversion_notes, export_config,
                                                              export_notes, family_for, family_of,
                                                              hf_config_from_model, model_config_from_hf, mtp_layers)
from ascend_llm_recipes.models.conversion.ours import (FORMAT_VERSION, HF_WEIGHTS_FILE, PER_EXPERT,
                                                       SOURCE_CONFIG, SOURCE_GENERATION_CONFIG, OurCheckpoint,
                                                       existing_conversion, fingerprint)
from ascend_llm_recipes.models.conversion.tables import (IGNORED_HF, IGNORED_OURS, TIED_HEAD, TRANSFORMS, check_tensors,
                                                         tensor_plan)
from ascend_llm_recipes.models.conversion.verify import verify_logits
from ascend_llm_recipes.models.conversion.write import (non_finite_report, progress_bar, refuse_non_finite,
                                                        tensor_sha256, write_conversion, write_ours)


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


GENERATION_CONFIG = "generation_config.json"  # transformers' GenerationConfig.save_pretrained


def read_generation_config(hf_dir: str) -> dict:
    """hf_dir's generation_config.json (sampling defaults and stop tokens) as read; None when it has none."""
    path = os.path.join(hf_dir, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        config = err
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not a JSON object of generation settings ({config})",
                              hint=f"repair it (transformers' GenerationConfig.save_pretrained writes it) or remove "
                                   f"it: --to-hf writes back the {GENERATION_CONFIG} it finds here")
    return config


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
            show_progress: bool = True, expert_layout: str = PER_EXPERT) -> dict:
    """Convert a HuggingFace directory into OUT_DIR (weights.safetensors, model_config.yaml, conversion.json).

    With verify, logits of transformers and of our model are compared before OUT_DIR is
    published; a conversion outside tolerance leaves no output. `expert_layout`: write.write_ours's.
    Returns the manifest.
    """
    start = time.perf_counter()
    hf_dir = os.path.abspath(hf_dir)
    hf_config, config_sha = read_hf_config(hf_dir)
    where = os.path.join(hf_dir, "config.json")
    cfg = model_config_from_hf(hf_config, where, seq_length)
    family = family_of(hf_config, where)
    hf = {**family.defaults, **hf_config}
    table = family.table_for(hf_config)  # DeepSeek-V3: by rope_interleave, recorded in the source and the notes
    weights = open_hf_weights(hf_dir)
    plan = tensor_plan(cfg, rows=table)
    found = {name: info[2] for name, info in weights.tensors.items()}
    tied_copy = (TIED_HEAD,) if cfg.tie_word_embeddings else ()
    mtp = tuple((rf"model\.layers\.{n}\..+", "multi-token-prediction module") for n in mtp_layers(hf))
    ignored = check_tensors(found, {p.hf: p.hf_shape for p in plan}, IGNORED_HF + mtp, hf_dir, extra_ok=tied_copy)
    not_converted = [name for name in ignored if any(re.fullmatch(pattern, name) for pattern, _ in mtp)]
    source = {"path": hf_dir, "model_type": family.model_type, "architectures": hf_config.get("architectures"),
              "config_sha256": config_sha, SOURCE_CONFIG: hf_config, "format": weights.format,
              "files": [{"file": name, "bytes": os.path.getsize(os.path.join(hf_dir, name))}
                        for name in weights.files]}
    if family.interleaved_rows is not None:
        source[ROPE_INTERLEAVE] = hf[ROPE_INTERLEAVE]
    generation = read_generation_config(hf_dir)
    if generation is not None:
        source[SOURCE_GENERATION_CONFIG] = generation

    def tokenizer_entries(work_dir: str) -> dict:
        note, files = copy_hf_tokenizer(hf_dir, work_dir, out_dir)
        return {"tokenizer": note, "tokenizer_files": files}

    check = (lambda work_dir: verify_logits(hf_dir, work_dir)) if verify else None
    return write_ours(weights, cfg, out_dir, "from-hf", source, f"Converted from {hf_dir} ({family.model_type})",
                      verify=check, ignored=[name for name in ignored if name not in not_converted],
                      show_progress=show_progress, more_files=tokenizer_entries, start=start, rows=table,
                      notes=conversion_notes(family, hf_config), not_converted=not_converted,
                      expert_layout=expert_layout)


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
             tokenizer: tuple = None, tokenizer_note: str = None, show_progress: bool = True,
             origin: dict = None) -> dict:
    """Convert one of our checkpoint files to OUT_DIR/config.json + model.safetensors (float32).

    `source` is recorded in the manifest; `tokenizer` (file, its dataset manifest entry) is copied beside
    the weights; `origin` (ours.hf_source) is the HuggingFace model the weights were converted from: its config.json
    keys are kept where ours do not decide them (hf_families.export_config) and its generation_config.json is
    written back. training/tools/export.py's to_hf finds these for a run or converted directory. Returns the manifest.
    """
    start = time.perf_counter()
    ckpt = OurCheckpoint(ckpt_path, cfg)  # either expert layout, read expert by expert
    hf_config, config_notes = export_config(cfg, origin)  # refuses a model no HF family has
    family = family_for(cfg)
    generation = (origin or {}).get("generation_config")
    plan = tensor_plan(cfg, tensor_parallel, rows=family.table)
    found = {name: info[1] for name, info in ckpt.tensors.items()}
    ignored = check_tensors(found, ckpt.expected({p.ours: p.our_shape for p in plan}), IGNORED_OURS, ckpt_path)
    existing = existing_conversion(out_dir, hf_config)

    def write_files(work_dir: str) -> dict:
        writer = SafetensorsWriter(os.path.join(work_dir, HF_WEIGHTS_FILE), {p.hf: p.hf_shape for p in plan},
                                   metadata={"format": "pt"})  # transformers refuses files without it
        records, non_finite = [], []
        with progress_bar(len(plan), "convert", show_progress) as bar:
            for item in plan:
                tensor = TRANSFORMS[item.transform][1](ckpt.read(item.ours), item.hf_shape, cfg)
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
        if generation is not None:
            with open(os.path.join(work_dir, GENERATION_CONFIG), "w", encoding="utf-8") as f:
                json.dump(generation, f, indent=2)
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
            "notes": config_notes + export_notes(family, cfg) + (
                [f"{GENERATION_CONFIG}: written as {origin['path']} had it"] if generation is not None else []),
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
