"""Loading a recipe: YAML files (with `base:` inheritance) < `--set` overrides, then the strict typed schema.

Every path is resolved once, at load; a MindFormers configuration given as a recipe gets one
message naming the command that imports it (training/recipe/mindformers.py).
"""

import io
import os
import shlex

import yaml

from ascend_llm_recipes.common.errors import RecipeError
from ascend_llm_recipes.common.schema import load_dataclass
from ascend_llm_recipes.models import LLAMA_CONFIG_TYPE, LLAMA_MODEL_TYPE
from ascend_llm_recipes.training.recipe.schema import Recipe


def parse_override(text: str) -> tuple:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as YAML)."""
    if "=" not in text:
        raise RecipeError("--set", [f"{text!r}: expected key.path=value"],
                          hint="e.g. --set runner_config.batch_size=4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError("--set", [f"{text!r}: empty key path"])
    if not raw.strip():
        return parts, ""
    try:
        return parts, yaml.load(raw, Loader=StrictLoader)
    except yaml.YAMLError as err:
        raise RecipeError("--set", [f"{text!r}: the value is not valid YAML ({_one_line(err)})"],
                          hint="quote the whole argument for the shell, e.g. --set 'lr_schedule={lr_end: 0.0}'") \
            from None


def apply_override(data: dict, parts: list, value, problems: list) -> None:
    """Set data[parts...] = value; list items are addressed by index (callbacks.1.prefix).

    A mapping given for a key that holds a mapping is merged into it key by key, as a recipe
    is merged over its base (`--set 'runner_config={batch_size: 2}'` keeps stop_step); any
    other value replaces what was there (`data_preparation=null` removes the section).
    """
    node = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[:depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                problems.append(f"--set {'.'.join(parts)}: {where} is not an index of a {len(node)}-item list")
                return
            node = node[int(part)]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        if not isinstance(node, (dict, list)):
            problems.append(f"--set {'.'.join(parts)}: {where} is a value, not a section")
            return
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            problems.append(f"--set {'.'.join(parts)}: {last} is not an index of a {len(node)}-item list")
            return
        last = int(last)
    elif last not in node:
        node[last] = value
        return
    if isinstance(value, dict) and isinstance(node[last], dict):
        node[last] = deep_merge(node[last], value)
    else:
        node[last] = value


def deep_merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def prune_inherited(data: dict, base: dict) -> dict:
    """`data` without the values `base` already has (the recipe inherits them)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            inner = prune_inherited(value, base[key])
            if inner:
                out[key] = inner
        elif key not in base or base[key] != value:
            out[key] = value
    return out


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives one key twice."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` keys may be overridden by the mapping's own keys
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(f"duplicate key {key!r} on line {line} (first on line {seen[key]}); "
                                            "the last one would silently win, give it once")
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep)


def _one_line(err: yaml.YAMLError) -> str:
    return " ".join(str(err).split())


def read_yaml_file(path: str, hint: str = "recipes live in recipes/, e.g. recipes/demo_cpu.yaml") -> dict:
    """The top-level mapping of a UTF-8 YAML file, read strictly (duplicate keys refused); RecipeError otherwise."""
    if not os.path.isfile(path):
        raise RecipeError(path, ["file not found" if not os.path.isdir(path) else "a directory, not a file"],
                          hint=hint)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = io.StringIO(raw.decode("utf-8-sig"))
        text.name = path  # YAML errors then name the file
        data = yaml.load(text, Loader=StrictLoader)
    except OSError as err:
        raise RecipeError(path, [f"cannot be read: {err.strerror}"]) from None
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise RecipeError(path, [f"not UTF-8 text: byte {raw[err.start]:#04x} on line {line}"],
                          hint=f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > NEW.yaml") from None
    except yaml.YAMLError as err:
        raise RecipeError(path, [f"not valid YAML: {_one_line(err)}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(path, ["the top level must be a mapping of sections"])
    return data


def read_recipe_file(path: str, chain: tuple = ()) -> dict:
    """The YAML mapping of `path`, with its `base:` file(s) (relative to it) merged underneath."""
    if not os.path.exists(path):
        where = f" (base of {chain[-1]})" if chain else ""
        raise RecipeError(path, [f"file not found{where}"],
                          hint="recipes live in recipes/, e.g. recipes/demo_cpu.yaml")
    if os.path.abspath(path) in chain:
        raise RecipeError(path, [f"base: circular inheritance through {' -> '.join(chain)}"])
    data = read_yaml_file(path)
    bases = data.pop("base", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise RecipeError(path, [f"base: expected a file name or a list of file names (relative to the recipe), "
                                 f"got {bases!r}"], hint="e.g. base: base/cpu.yaml")
    merged: dict = {}
    for base in bases:
        base_path = os.path.join(os.path.dirname(path), base)
        merged = deep_merge(merged, read_recipe_file(base_path, chain + (os.path.abspath(path),)))
    return deep_merge(merged, data)


def load_recipe(path: str, overrides: tuple = (), planning: bool = False) -> Recipe:
    """Read (with bases), override, validate. Raises RecipeError listing every problem found.

    planning=True validates everything except what only matters when executing on this
    machine's CPU (bf16, tensor/pipeline parallel), so Ascend layouts can be planned here.
    """
    data = read_recipe_file(path)
    problems: list = []
    for text in overrides:
        apply_override(data, *parse_override(text), problems)
    return recipe_from_dict(data, path, problems, planning)


def recipe_from_dict(data: dict, source: str = "<dict>", problems: list = None, planning: bool = False) -> Recipe:
    """Validate an already-parsed recipe; `problems` carries earlier findings (e.g. from --set).

    The launcher (load_recipe) and every worker (RUN_DIR/recipe.yaml) validate through here,
    on paths resolved the same way, so they cannot disagree about a recipe.
    """
    problems = list(problems or [])
    refuse_mindformers_config(data, source)
    recipe = load_dataclass(Recipe, data, "", problems)
    recipe.planning = planning
    if not problems:
        resolve_paths(recipe)
        problems.extend(recipe.check())
    if problems:
        raise RecipeError(source, problems)
    return recipe


def resolve_path(path: str) -> str:
    """A recipe path made absolute against the current working directory, symlinks followed ('' stays '')."""
    return os.path.realpath(os.path.expanduser(path)) if path else path


def resolve_paths(recipe: Recipe) -> None:
    """Every path of the recipe resolved once, at load: relative paths are relative to the working directory."""
    recipe.output_dir = resolve_path(recipe.output_dir)
    recipe.load_checkpoint = resolve_path(recipe.load_checkpoint)
    recipe.load_optimizer_state = resolve_path(recipe.load_optimizer_state)
    ascend = recipe.context.ascend_config
    if ascend is not None and ascend.parallel_speed_up_json_path:
        ascend.parallel_speed_up_json_path = resolve_path(ascend.parallel_speed_up_json_path)
    loaders = [recipe.train_dataset.data_loader, *(recipe.train_dataset.blend or [])]
    if recipe.eval_dataset is not None:
        loaders.append(recipe.eval_dataset.data_loader)
    for loader in loaders:
        loader.dataset_dir = resolve_path(loader.dataset_dir)
    if recipe.data_preparation is not None:
        recipe.data_preparation.output_dir = resolve_path(recipe.data_preparation.output_dir)
    task = recipe.train_dataset_task
    loader = (task.dataset_config or {}).get("data_loader")
    if isinstance(loader, dict) and isinstance(loader.get("dataset_dir"), str):
        # The `dataset_config: *train_dataset` copy must keep comparing equal to train_dataset.
        loader = dict(loader, dataset_dir=resolve_path(loader["dataset_dir"]))
        task.dataset_config = dict(task.dataset_config, data_loader=loader)


# What only a MindFormers configuration has: sections and keys of MindFormers that recipes do not
# use, and MindFormers' own model classes (recipes train models/llama.py's).
MINDFORMERS_KEYS = ("processor", "metric", "eval_callbacks", "eval_dataset_task", "src_strategy_path_or_dir",
                    "only_save_strategy", "micro_batch_interleave_num", "moe_config",
                    "auto_tune", "filepath_prefix", "autotune_per_step", "profile_start_step", "profile_stop_step",
                    "profile_communication", "profile_memory", "init_start_profile", "layer_scale", "layer_decay",
                    "lr_scale_factor", "remote_save_url", "use_past", "monitor_config")


def mindformers_markers(data: dict) -> list:
    """The keys and model types of `data` that only a MindFormers configuration has."""
    found = []
    model = data.get("model")
    if isinstance(model, dict):
        for section, ours in (("model_config", LLAMA_CONFIG_TYPE), ("arch", LLAMA_MODEL_TYPE)):
            block = model.get(section)
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != ours and (kind.endswith("Config") or "For" in kind):
                found.append(f"model.{section}.type {kind}")
    found.extend(key for key in MINDFORMERS_KEYS if key in data)
    if isinstance(data.get("profile"), bool):
        found.append("profile: " + str(data["profile"]))
    return found


def refuse_mindformers_config(data: dict, source: str) -> None:
    """A MindFormers configuration gets one message saying so and how to import it, not a list of key errors."""
    markers = mindformers_markers(data)
    if len(markers) >= 2:
        raise RecipeError(source, [f"this is a MindFormers configuration, not a recipe of this repository (it has "
                                   f"{', '.join(markers[:6])}{', ...' if len(markers) > 6 else ''})"],
                          hint="convert it with: python scripts/convert_recipe.py --from-mindformers "
                               f"{shlex.quote(source)} --output recipes/NAME.yaml")
