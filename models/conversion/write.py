"""The one way a conversion reaches its output directory (write_conversion), our format's writer (write_ours),
and the summary printed at the end.

Output is built in a hidden sibling directory and renamed into place when complete, so a failed or
interrupted conversion leaves nothing behind; NaN and inf weights are refused.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.common.schema import to_plain
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.shapes import dimensions
from ascend_llm_recipes.models.conversion.formats import HFWeights, SafetensorsWriter
from ascend_llm_recipes.models.conversion.ours import (CHECKPOINT_FILE, FORMAT_VERSION, MANIFEST_FILE,
                                                       MODEL_SECTION_FILE, MOMENT_FILES, OPTIMIZER_DIR, PER_EXPERT,
                                                       STACKED, existing_conversion, fingerprint, model_section_yaml,
                                                       recipe_keys, stacked_names, stacked_shapes, stacked_tensor)
from ascend_llm_recipes.models.conversion.tables import (TIED_HEAD, TRANSFORMS, ignored_kinds, pad_vocab_rows,
                                                         tensor_plan)
from ascend_llm_recipes.models.conversion.verify import PARITY_RULE


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


def tensor_sha256(array: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).hexdigest()


def write_ours(weights: HFWeights, cfg: ModelConfig, out_dir: str, direction: str, source: dict, header: str,
               verify=None, ignored=(), show_progress: bool = True, moments=None, more_files=None, start=None,
               rows: dict = None, notes=(), expert_layout: str = PER_EXPERT, **extra) -> dict:
    """OUT_DIR in our format (weights.safetensors, model_config.yaml, conversion.json) from HF-named `weights`.

    from_hf, megatron.from_megatron and torch_state.from_torch all write through here (and so through
    write_conversion). moments ({"adam_m": HF-named moments, "adam_v": ...}) go to optimizer/adam_m.safetensors
    and adam_v.safetensors under the weights' names; more_files(work_dir) writes further files and returns
    their manifest entries (the tokenizer of from_hf); verify(work_dir) returns the parity result. `rows`: the
    HuggingFace family's table naming `weights` (tables.tensor_plan; HF_TABLE by default). `notes`: what the
    model section cannot say (DeepSeek-V3's rotary layout, ...), written into its header and the manifest.
    `expert_layout`: a MoE model's experts per expert (PER_EXPERT, our CPU model's) or STACKED as MindFormers'
    MoELayer holds them (ours.EXPERT_STACKS; what a MoE recipe runs on Ascend), recorded in the manifest.
    """
    plan = tensor_plan(cfg, rows=rows)
    model = to_plain(cfg)
    notes = list(notes) + check_expert_layout(expert_layout, cfg, source["path"])
    existing = existing_conversion(out_dir, model)
    if existing is not None and existing.get("expert_layout", PER_EXPERT) != expert_layout and cfg.moe:
        raise ConversionError(f"output {out_dir} already holds this model with its experts "
                              f"{existing.get('expert_layout', PER_EXPERT)}, not {expert_layout}",
                              hint="choose another --output, or remove the old conversion first")

    def write_files(work_dir: str) -> dict:
        tensors = write_weights(weights, plan, cfg, os.path.join(work_dir, CHECKPOINT_FILE), show_progress,
                                source["path"], direction, expert_layout)
        if TIED_HEAD in ignored:
            check_tied_copy(weights, tensors)
        for prefix, values in (moments or {}).items():
            os.makedirs(os.path.join(work_dir, OPTIMIZER_DIR), exist_ok=True)
            write_weights(values, plan, cfg, os.path.join(work_dir, OPTIMIZER_DIR, f"{prefix}.safetensors"),
                          show_progress, f"{source['path']} ({MOMENT_FILES[prefix]})", direction, expert_layout)
        with open(os.path.join(work_dir, MODEL_SECTION_FILE), "w", encoding="utf-8") as f:
            f.write(model_section_yaml(cfg, f"{header} by scripts/convert_checkpoint.py.\n" +
                                       "".join(f"{note}.\n" for note in notes) + recipe_keys(out_dir)))
        manifest = {"format_version": FORMAT_VERSION, "direction": direction,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": source,
                    "checkpoint": CHECKPOINT_FILE, "dtype": "float32", "model": model,
                    "padded_vocab_size": dimensions(cfg)["padded_vocab"], "tensors": tensors,
                    "ignored": list(ignored), "notes": list(notes), "fingerprint": fingerprint(model, tensors),
                    **({"expert_layout": expert_layout} if cfg.moe else {}), **extra}
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


def write_weights(weights: HFWeights, plan: list, cfg: ModelConfig, path: str, show_progress: bool, where: str,
                  direction: str, expert_layout: str = PER_EXPERT) -> list:
    """Our safetensors file of `weights` (HF-named) along `plan`, one tensor at a time; returns the records.

    With expert_layout STACKED each MoE layer's stacked tensors stand where their first part did, each made from its
    parts as they are read (ours.stacked_tensor): one layer's experts in memory at a time.
    """
    items = {p.ours: p for p in plan}
    stacks = stacked_names(cfg) if expert_layout == STACKED else {}
    shapes = {p.ours: p.our_shape for p in plan}
    shapes = stacked_shapes(shapes, cfg) if stacks else shapes

    def read(name: str) -> np.ndarray:
        item = items[name]
        return TRANSFORMS[item.transform][0](weights.read(item.hf), item.our_shape, cfg)

    # MindSpore's save_checkpoint(format="safetensors") marks its files the same way.
    writer = SafetensorsWriter(path, shapes, metadata={"format": "ms"})
    records, non_finite = [], []
    with progress_bar(len(shapes), "convert", show_progress) as bar:
        for name in shapes:
            sources = [items[part].hf for part in stacks.get(name, [name])]
            tensor = stacked_tensor(name, read, cfg) if name in stacks else read(name)
            non_finite += non_finite_report(sources[0] if len(sources) == 1 else f"{name} (stacked)", tensor)
            writer.write(name, tensor)
            records.append({"name": name, "source": sources[0] if name not in stacks else sources,
                            "source_dtype": weights.tensors[sources[0]][1],
                            "transform": items[name].transform if name not in stacks else "expert_stack",
                            "shape": list(tensor.shape), "sha256": tensor_sha256(tensor)})
            del tensor  # keep one tensor alive at a time
            bar.update()
    writer.close()
    refuse_non_finite(non_finite, where, direction)
    return records


def check_expert_layout(expert_layout: str, cfg: ModelConfig, where: str) -> list:
    """The notes of an expert layout, refused by name for a model it does not apply to."""
    if expert_layout == PER_EXPERT:
        return []
    if expert_layout != STACKED:
        raise ConversionError(f"--expert-layout {expert_layout}: unknown; use {PER_EXPERT} or {STACKED}")
    if not cfg.moe:
        raise ConversionError(f"--expert-layout {STACKED}: {where} is a dense model (num_experts 0); only "
                              "Mixture-of-Experts layers are stacked", hint="leave out --expert-layout")
    return ["MoE layers stacked as MindFormers' MoELayer holds them (mlp.router.weight, mlp.experts.weight1, "
            "weight2), for a recipe running them on Ascend; --to-hf and --to-megatron read them back"]


def check_tied_copy(weights: HFWeights, records: list) -> None:
    """A tied checkpoint that stores lm_head.weight must store the embedding again, nothing else."""
    embedding = next(r for r in records if r["source"] == "model.embed_tokens.weight")
    head = pad_vocab_rows(weights.read(TIED_HEAD), tuple(embedding["shape"]))
    if tensor_sha256(head) != embedding["sha256"]:
        raise ConversionError(f"{TIED_HEAD}: differs from model.embed_tokens.weight although config.json sets "
                              "tie_word_embeddings: true",
                              hint="set tie_word_embeddings: false if the head is a separate matrix")


def non_finite_report(name: str, tensor: np.ndarray) -> list:
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


def refuse_non_finite(problems: list, where: str, direction: str) -> None:
    if problems:
        raise ConversionError(f"{where}: non-finite values in {len(problems)} tensor(s): {', '.join(problems[:10])}"
                              + (f" and {len(problems) - 10} more" if len(problems) > 10 else "")
                              + "; nothing was written",
                              hint=f"{NON_FINITE_HINTS[direction]}; a NaN or inf weight makes every prediction NaN")


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
    if manifest.get("not_converted"):
        text += f"; did not convert {len(manifest['not_converted'])} tensors (named in {MANIFEST_FILE})"
    if manifest.get("tokenizer"):
        text += f"; tokenizer {manifest['tokenizer']}"
    text += "".join(f". Note: {note}" for note in manifest.get("notes", ()))
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
