"""torch.save'd state dicts -> ours: HuggingFace names, other names through a key map, or Meta's Llama layout.

    from_torch(FILE, OUT_DIR, model_config)  FILE holds HF names (config.json, model_config.yaml or a
                                             recipe says which model), names a --key-map renames, or
                                             Meta's original layout: consolidated.NN.pth + params.json

Output is what hf.py's from_hf writes, through write.py's write_ours and write_conversion: the
tensors are presented under HuggingFace names and everything downstream is shared.

Meta's layout (the original Llama releases, facebookresearch/llama model.py; torchtitan saves the
same names) is recognised by its tensor names and converted by one table, tables.META_TABLE: each HF
tensor's Meta name, the transform from Meta's values to HF's, and the dimension Meta's
model-parallel shards split (fairscale ColumnParallelLinear rows, RowParallelLinear columns,
ParallelEmbedding the hidden dimension in Llama 1/2, VocabParallelEmbedding the rows in Llama 3;
norms are replicated). Meta's rotary embedding rotates consecutive pairs of a head's q/k rows
(view_as_complex), HF's and ours the two halves, so wq and wk rows are permuted per head: the
`permute` of transformers' convert_llama_weights_to_hf.py (not shipped in the wheel), which is
also why Meta's layout must not go through a key map (the rows would be copied unpermuted).
"""

import dataclasses
import json
import math
import os
import re
import tempfile

import numpy as np
import yaml

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.config import ModelConfig
from ascend_llm_recipes.models.conversion.formats import HFWeights, SafetensorsWriter, TorchBinFile
from ascend_llm_recipes.models.conversion.hf_families import (DEFAULT_MAX_SEQ_LENGTH, NO_TOKEN, hf_config_from_model,
                                                              model_config_from_hf)
from ascend_llm_recipes.models.conversion.ours import HF_WEIGHTS_FILE, PER_EXPERT
from ascend_llm_recipes.models.conversion.tables import (META_TABLE, TIED_HEAD, TRANSFORMS, check_tensors, tensor_plan,
                                                         template_of)
from ascend_llm_recipes.models.conversion.verify import reference_logits, verify_against
from ascend_llm_recipes.models.conversion.write import write_ours


STATE_DICT_KEYS = ("model", "model_state_dict", "state_dict", "module")


class TorchStateFile(TorchBinFile):
    """A torch.save'd state dict, or a dict holding one under model / model_state_dict / state_dict / module."""

    def _load(self) -> dict:
        state = super()._load()
        for key in STATE_DICT_KEYS:
            if isinstance(state.get(key), dict):
                return state[key]
        return state


KEY_MAP_FORMAT = "`their name pattern: HF name pattern` ({n} = a layer number, {name} = any text; null = ignore)"


def read_key_map(path: str) -> list:
    """(compiled source pattern, target template, pattern) triples of a --key-map YAML; target None = ignore."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise ConversionError(f"{path}: cannot read the key map ({err})",
                              hint="quote patterns that start with { ('{rest}': 'model.{rest}'): unquoted, YAML "
                                   "reads {...} as a mapping") from None
    if not isinstance(data, dict) or not data:
        raise ConversionError(f"{path}: expected a mapping {KEY_MAP_FORMAT}")
    problems = []
    for theirs, ours in data.items():
        if not isinstance(theirs, str):
            problems.append(f"{theirs!r}: the pattern is a YAML {type(theirs).__name__}, not a name; quote it")
        elif isinstance(ours, dict):
            braces = "{" + ", ".join(str(k) for k in ours) + "}"
            problems.append(f"{theirs}: the value {ours!r} is a YAML mapping, not a name (unquoted, YAML reads "
                            f"{braces} as one); quote it: '{theirs}': '{braces}'")
        elif ours is not None and not isinstance(ours, str):
            problems.append(f"{theirs}: the value {ours!r} is not a name (an HF name pattern, or null to ignore)")
        else:
            captured = re.findall(r"\{(\w+)\}", theirs)
            problems += [f"{theirs}: {{{name}}} appears twice" for name in sorted(set(captured))
                         if captured.count(name) > 1]
            problems += [f"{theirs}: the value {ours!r} uses {{{name}}}, which the pattern does not capture"
                         for name in re.findall(r"\{(\w+)\}", ours or "") if name not in captured]
    if problems:
        raise ConversionError(f"{path}: {len(problems)} problem(s) in the key map:\n" +
                              "\n".join(f"  - {p}" for p in problems), hint=f"write it as {KEY_MAP_FORMAT}")
    return [(_pattern_regex(theirs), ours, theirs) for theirs, ours in data.items()]


def _pattern_regex(pattern: str):
    """A name pattern -> a regex: {n} matches a layer number, any other {name} any text."""
    parts = re.split(r"(\{\w+\})", pattern)
    regex = "".join(f"(?P<{p[1:-1]}>\\d+)" if p == "{n}" else f"(?P<{p[1:-1]}>.+?)" if p.startswith("{")
                    else re.escape(p) for p in parts if p)
    return re.compile(regex + r"\Z")


def apply_key_map(names, rules: list, where: str) -> tuple:
    """({HF name: their name}, [ignored]) for the names of a state dict."""
    mapped, ignored, problems = {}, [], []
    for name in names:
        for regex, target, pattern in rules:
            match = regex.match(name)
            if match:
                if target is None:
                    ignored.append(name)
                else:
                    new = target.format(**match.groupdict())
                    if new in mapped:
                        problems.append(f"{name}: maps to {new}, as {mapped[new]} does")
                    mapped[new] = name
                break
        else:
            mapped.setdefault(name, name)  # unmapped names are taken as HF names (checked against the plan)
    if problems:
        raise ConversionError(f"{where}: key map collisions:\n" + "\n".join(f"  - {p}" for p in problems))
    return mapped, ignored


META_RULES = [(_pattern_regex(row.theirs[0]), row.ours, row.theirs[0]) for row in META_TABLE.values()] + \
    [(re.compile(r"rope\.freqs\Z"), None, "rope.freqs")]  # Llama 1's rotary table, recomputed from rope_theta
META_SHARD = re.compile(r"consolidated\.(\d+)\.pth")


def is_meta_layout(names) -> bool:
    """Whether a state dict uses Meta's names (tok_embeddings, layers.N.attention.wq, ...)."""
    return any(regex.match(name) for name in names for regex, _, _ in META_RULES)


def shard_files(path: str) -> list:
    """[path], or for Meta's consolidated.00.pth every consolidated.NN.pth beside it, in rank order."""
    match = META_SHARD.fullmatch(os.path.basename(path))
    if not match:
        return [path]
    directory = os.path.dirname(path)
    found = sorted((f for f in os.listdir(directory) if META_SHARD.fullmatch(f)),
                   key=lambda f: int(META_SHARD.fullmatch(f).group(1)))
    expected = [f"consolidated.{i:02d}.pth" for i in range(len(found))]
    if found != expected:
        raise ConversionError(f"{directory}: model-parallel shards {', '.join(found)} are not "
                              f"{', '.join(expected)}: a shard is missing or misnamed",
                              hint="copy every consolidated.NN.pth of the release")
    if int(match.group(1)) != 0:
        raise ConversionError(f"{path}: name the first shard, {os.path.join(directory, expected[0])}; all "
                              f"{len(found)} shards beside it are merged")
    return [os.path.join(directory, f) for f in found]


class MetaWeights(HFWeights):
    """Meta's model-parallel shards seen as HuggingFace-named, merged and permuted tensors (tables.META_TABLE)."""

    def __init__(self, shards: list, cfg: ModelConfig, mapped: dict):
        self.shards, self.cfg = shards, cfg
        self.sources = {}  # HF name -> (Meta name, transform, split dimension or None, shape)
        expected = {p.hf: p.hf_shape for p in tensor_plan(cfg)}
        tensors = {}
        for hf, meta in mapped.items():
            pattern = template_of(hf)[0]
            if pattern not in META_TABLE:  # not one of Meta's names: check_tensors reports it as unknown
                tensors[hf] = (self, shards[0].tensors[meta][0], shards[0].tensors[meta][1])
                continue
            row = META_TABLE[pattern]
            dim, shape = self._merged_shape(meta, row.split, expected.get(hf))
            self.sources[hf] = (meta, row.transform, dim, shape)
            tensors[hf] = (self, shards[0].tensors[meta][0], shape)
        super().__init__("meta", [os.path.basename(s.path) for s in shards], tensors)

    def _merged_shape(self, meta: str, dims, expected) -> tuple:
        """(split dimension, merged shape): the candidate dimension that gives the expected shape, else the first."""
        shapes = [s.tensors[meta][1] for s in self.shards]
        if not dims:  # replicated: read() checks that the shards agree
            return None, shapes[0]
        merged = []
        for dim in dims:
            shape = list(shapes[0])
            shape[dim] = sum(s[dim] for s in shapes)
            merged.append((dim, tuple(shape)))
        return next((m for m in merged if m[1] == tuple(expected or ())), merged[0])

    def read(self, name: str) -> np.ndarray:
        meta, transform, dim, shape = self.sources[name]
        parts = [s.read(meta) for s in self.shards]
        if dim is None:
            if any(not np.array_equal(parts[0], p) for p in parts[1:]):
                raise ConversionError(f"{meta}: differs between model-parallel shards although Meta replicates it")
            merged = parts[0]
        else:
            merged = np.concatenate(parts, axis=dim)
        del parts
        return TRANSFORMS[transform][0](merged, shape, self.cfg)


META_PARAMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
               "norm_eps", "rope_theta", "use_scaled_rope", "max_seq_len", "max_batch_size")
# Meta's params.json names no token ids: those of Meta's tokenizers for the vocabulary size (sentencepiece
# Llama 1/2: bos 1, eos 2; tiktoken Llama 3: 128000, 128001). The recipe may set others; launches check them.
META_TOKEN_IDS = {128256: (128000, 128001)}


def is_meta_params(config: dict) -> bool:
    return "model_type" not in config and "dim" in config.get("model", config)


def model_config_from_meta(params: dict, where: str, shards: list, seq_length: int = None) -> ModelConfig:
    """Meta's params.json -> our model_config (intermediate size as Meta's FeedForward computes it)."""
    params = params.get("model", params)
    problems = [f"{key}: missing" for key in ("dim", "n_layers", "n_heads", "norm_eps") if key not in params]
    problems += [f"{key}: not a key of Meta's Llama params.json (only {', '.join(META_PARAMS)} are): this is not "
                 "a plain Llama decoder" for key in params if key not in META_PARAMS]
    if params.get("use_scaled_rope"):
        problems.append("use_scaled_rope: true is not supported: rotary positions are unscaled (Llama 3.1's "
                        "frequency scaling changes them)")
    problems += [f"{key}: {params[key]!r} is not a positive integer" for key in ("dim", "n_layers", "n_heads",
                                                                                 "n_kv_heads", "multiple_of")
                 if params.get(key) is not None and (type(params[key]) is not int or params[key] < 1)]
    if problems:
        raise ConversionError(f"{where}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    dim, heads = params["dim"], params["n_heads"]
    # Meta's FeedForward: hidden = int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to multiple_of
    multiple_of, ffn = params.get("multiple_of", 256), int(2 * 4 * dim / 3)
    if params.get("ffn_dim_multiplier") is not None:
        ffn = int(params["ffn_dim_multiplier"] * ffn)
    intermediate = multiple_of * ((ffn + multiple_of - 1) // multiple_of)
    vocab = params.get("vocab_size", -1)
    names = shards[0].tensors
    if vocab is None or vocab < 1:  # Llama 1/2 write -1: the tokenizer's size, which the embedding has
        rows, width = names["tok_embeddings.weight"][1] if "tok_embeddings.weight" in names else (0, 0)
        vocab = rows if width * len(shards) == dim else rows * len(shards)
    bos, eos = META_TOKEN_IDS.get(vocab, (1, 2))
    return ModelConfig(vocab_size=vocab, hidden_size=dim, num_layers=params["n_layers"], num_heads=heads,
                       num_kv_heads=params.get("n_kv_heads") or heads, intermediate_size=intermediate,
                       seq_length=seq_length or params.get("max_seq_len") or DEFAULT_MAX_SEQ_LENGTH,
                       rms_norm_eps=float(params["norm_eps"]), rope_theta=float(params.get("rope_theta", 10000.0)),
                       tie_word_embeddings="output.weight" not in names, bos_token_id=bos, eos_token_id=eos,
                       pad_token_id=NO_TOKEN)


def meta_reference_logits(weights: MetaWeights, tokens: np.ndarray) -> np.ndarray:
    """Logits (batch, seq, vocab) of a pure-torch forward written after Meta's llama/model.py, on Meta's shards.

    Each model-parallel rank computes with the tensors it holds, in Meta's rotary order (consecutive
    pairs as complex numbers); wo and w2 outputs are summed and output logits concatenated, as
    fairscale's RowParallel/ColumnParallel layers do. Neither the merge nor the q/k permutation of
    the conversion is used, so both are checked, not assumed.
    """
    import torch
    import torch.nn.functional as F

    cfg, shards = weights.cfg, weights.shards
    head_dim = cfg.head_size
    batch, seq = tokens.shape

    def t(shard, name):
        return torch.from_numpy(shard.read(name)).double()

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs_cis = torch.polar(torch.ones(seq, head_dim // 2, dtype=torch.float64),
                            torch.outer(torch.arange(seq, dtype=torch.float64), freqs))

    def rotary(x):  # (B, S, heads, head_dim): consecutive pairs are one complex number
        pairs = torch.view_as_complex(x.reshape(batch, seq, x.shape[2], head_dim // 2, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(3)

    table_dim = weights.sources["model.embed_tokens.weight"][2] or 0
    x = F.embedding(torch.from_numpy(tokens), torch.cat([t(s, "tok_embeddings.weight") for s in shards], table_dim))
    mask = torch.triu(torch.full((seq, seq), float("-inf"), dtype=torch.float64), 1)
    for n in range(cfg.num_layers):
        h = rms(x, t(shards[0], f"layers.{n}.attention_norm.weight"))
        attn = 0
        for s in shards:
            # (B, S, local heads x head_dim) -> (B, S, local heads, head_dim)
            q = rotary((h @ t(s, f"layers.{n}.attention.wq.weight").T).view(batch, seq, -1, head_dim))
            k = rotary((h @ t(s, f"layers.{n}.attention.wk.weight").T).view(batch, seq, -1, head_dim))
            v = (h @ t(s, f"layers.{n}.attention.wv.weight").T).view(batch, seq, -1, head_dim)
            repeat = q.shape[2] // k.shape[2]  # Meta's repeat_kv
            q, k, v = (y.transpose(1, 2) for y in (q, k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)))
            context = ((q @ k.transpose(-1, -2)) / math.sqrt(head_dim) + mask).softmax(-1) @ v  # (B, h, S, d)
            attn = attn + context.transpose(1, 2).reshape(batch, seq, -1) @ t(s, f"layers.{n}.attention.wo.weight").T
        x = x + attn
        h = rms(x, t(shards[0], f"layers.{n}.ffn_norm.weight"))
        x = x + sum((F.silu(h @ t(s, f"layers.{n}.feed_forward.w1.weight").T) *
                     (h @ t(s, f"layers.{n}.feed_forward.w3.weight").T)) @ t(s, f"layers.{n}.feed_forward.w2.weight").T
                    for s in shards)
    x = rms(x, t(shards[0], "norm.weight"))
    if cfg.tie_word_embeddings:
        return (x @ torch.cat([t(s, "tok_embeddings.weight") for s in shards], table_dim).T).numpy()
    return torch.cat([x @ t(s, "output.weight").T for s in shards], -1).numpy()


def hf_reference_logits(weights: HFWeights, hf_config: dict, names: list, tokens: np.ndarray,
                        scratch: str) -> np.ndarray:
    """transformers' logits for the source tensors under their (mapped) HF names, saved as an HF directory.

    The directory is made in `scratch` (the conversion's work directory, so on the output's disk) and removed.
    """
    with tempfile.TemporaryDirectory(prefix=".reference-", dir=scratch) as hf_dir:
        with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f)
        writer = SafetensorsWriter(os.path.join(hf_dir, HF_WEIGHTS_FILE), {n: weights.tensors[n][2] for n in names},
                                   metadata={"format": "pt"})
        for name in names:
            writer.write(name, weights.read(name))
        writer.close()
        return reference_logits(hf_dir, tokens)


def read_json_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path}: cannot read the model config ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: holds a JSON {type(config).__name__}, not a model config object")
    return config


def from_torch(path: str, out_dir: str, model_config: str, cfg: ModelConfig = None, key_map: str = None,
               seq_length: int = None, verify: bool = False, show_progress: bool = True,
               expert_layout: str = PER_EXPERT) -> dict:
    """Convert a torch.save'd state dict (HF names, names a key map renames, or Meta's layout) into OUT_DIR.

    `model_config`: a config.json or Meta's params.json, read here when cfg is None; or the model
    section / recipe cfg was read from (training/tools/export.py), recorded in the manifest. With verify,
    our logits are compared before OUT_DIR is published: with transformers' on the source tensors
    (HF names), or with meta_reference_logits (Meta's layout). `expert_layout`: write.write_ours's.
    """
    path = os.path.abspath(path)
    shards = [TorchStateFile(f) for f in shard_files(path)]
    names = shards[0].tensors
    meta = is_meta_layout(names)
    where = path + (f" (through {key_map})" if key_map else "")
    if meta and key_map:
        raise ConversionError(f"{path}: holds Meta's Llama layout (tok_embeddings, layers.N.attention.wq, ...), "
                              f"which converts without {key_map}: its q/k rows are in Meta's rotary order and are "
                              "permuted on the way; a key map would copy them unpermuted",
                              hint="drop --key-map")
    if len(shards) > 1 and not meta:
        raise ConversionError(f"{path}: consolidated.NN.pth shards merge only in Meta's layout (tok_embeddings, "
                              "layers.N.attention.wq, ...); these hold other names")
    for shard in shards[1:]:
        if set(shard.tensors) != set(names):
            differ = sorted(set(shard.tensors) ^ set(names))
            raise ConversionError(f"{shard.path}: holds other tensors than {shards[0].path} ({', '.join(differ[:5])})",
                                  hint="the shards come from different checkpoints")
    config = read_json_config(model_config) if cfg is None else None
    if config is not None and is_meta_params(config):
        cfg = model_config_from_meta(config, model_config, shards, seq_length)
    elif config is not None:
        cfg = model_config_from_hf(config, model_config, seq_length)
    elif seq_length:
        cfg = dataclasses.replace(cfg, seq_length=seq_length)
    rules = META_RULES if meta else read_key_map(key_map) if key_map else []
    mapped, ignored = apply_key_map(names, rules, key_map or path)
    if meta:
        weights = MetaWeights(shards, cfg, mapped)
    else:
        weights = HFWeights("torch", [os.path.basename(path)],
                            {hf: (_Renamed(shards[0], theirs), *names[theirs]) for hf, theirs in mapped.items()})
    plan = tensor_plan(cfg)
    found = {name: info[2] for name, info in weights.tensors.items()}
    tied_copy = (TIED_HEAD,) if cfg.tie_word_embeddings else ()
    ignored += check_tensors(found, {p.hf: p.hf_shape for p in plan}, (), where, extra_ok=tied_copy)
    source = {"path": path, "format": "meta" if meta else "torch", "model_config": os.path.abspath(model_config),
              "key_map": os.path.abspath(key_map) if key_map else None,
              "files": [{"file": os.path.basename(s.path), "bytes": os.path.getsize(s.path)} for s in shards]}
    check = None
    if verify and meta:
        check = (lambda work_dir: verify_against(lambda tokens: meta_reference_logits(weights, tokens), work_dir,
                                                 path, name="a pure-torch forward after Meta's llama/model.py",
                                                 hint="nothing was written; the shards do not hold Meta's layout as "
                                                      "this converter reads it: report params.json and the names"))
    elif verify:
        hf_config = config if config is not None and not is_meta_params(config) else hf_config_from_model(cfg)
        kept = [p.hf for p in plan]
        check = (lambda work_dir: verify_against(
            lambda tokens: hf_reference_logits(weights, hf_config, kept, tokens, work_dir), work_dir, where))
    header = f"Converted from {path}" + (f" (Meta's layout, {len(shards)} model-parallel shard(s))" if meta else "")
    return write_ours(weights, cfg, out_dir, "from-torch", source, header, verify=check, ignored=ignored,
                      show_progress=show_progress, expert_layout=expert_layout)


class _Renamed:
    """Reads an HF-named tensor under the name the file uses."""

    def __init__(self, reader, name: str):
        self.reader, self.name = reader, name

    def read(self, _hf_name: str) -> np.ndarray:
        return self.reader.read(self.name)
