"""Megatron-LM and torch.save imports, proven on checkpoints written by real megatron-core.

The fixtures (conftest.py megatron_dir: tests/make_megatron_fixtures.py, one launch of 4 ranks per session) are
megatron-core's own GPTModel at TP1 (tied embeddings), TP2 (q/k/v bias) and TP2xPP2 with grouped-query attention,
saved in the legacy and torch_dist formats, with megatron-core's forward logits on fixed tokens. Its MoE layouts are
read by tests/test_megatron_moe.py.
"""

import collections
import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from conftest import TINY_RECIPE, load_script
from ascend_llm_recipes.models.conversion.ours import CHECKPOINT_FILE, HF_WEIGHTS_FILE, MODEL_SECTION_FILE
from ascend_llm_recipes.models.conversion.megatron import from_megatron
from ascend_llm_recipes.models.conversion import megatron_files
from test_convert import assert_nothing_written, make_hf_model
from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.training.tools.export import from_torch, to_megatron, write_recipe, to_hf
from ascend_llm_recipes.training.launcher.cli import launch
from ascend_llm_recipes.training.tools.planner import plan
from ascend_llm_recipes.training.recipe.loading import load_recipe
from ascend_llm_recipes.training.checkpoint import step_dir

LAYOUTS = ("tp1", "tp2", "tp2pp2")
FORMATS = ("legacy", "torch_dist")
PARITY = 1e-4  # max |delta logits| against megatron-core's own forward


def transformers_logits(hf_dir, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(torch.from_numpy(tokens)).logits.double().numpy()


def max_delta_to_megatron(megatron_dir, layout, hf_dir) -> float:
    tokens = np.load(megatron_dir / layout / "tokens.npy")
    return float(np.abs(transformers_logits(hf_dir, tokens) - np.load(megatron_dir / layout / "logits.npy")).max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_converted_and_exported_logits_equal_megatron_cores(tmp_path, megatron_dir, layout, fmt):
    """Megatron -> ours -> --to-hf -> transformers gives megatron-core's logits on the same tokens."""
    manifest = from_megatron(str(megatron_dir / layout / fmt), str(tmp_path / "ours"), show_progress=False)
    assert manifest["source"]["iteration"] == 40 and manifest["padded_vocab_size"] == 512  # Megatron padded to 576
    model = yaml.safe_load((tmp_path / "ours" / MODEL_SECTION_FILE).read_text())["model"]["model_config"]
    assert (model["num_layers"], model["num_kv_heads"], model["rope_theta"]) == (4, 2, 500000.0)
    assert model["tie_word_embeddings"] == (layout == "tp1") and model["qkv_bias"] == (layout == "tp2")
    to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), show_progress=False)
    delta = max_delta_to_megatron(megatron_dir, layout, tmp_path / "hf")
    print(f"\n[parity] {layout} {fmt}: max |delta logits| vs megatron-core {delta:.2e}")
    assert delta < PARITY


def test_verify_accepts_the_right_layouts_and_rejects_wrong_ones(tmp_path, megatron_dir, monkeypatch):
    """A wrong qkv layout or fc1 merge converts without complaint; only the logits check catches it.

    The conversion with --verify and the Adam moments reads every tensor of the 4 rank files ~6 times: each
    file is loaded once.
    """
    legacy = str(megatron_dir / "tp2pp2" / "legacy")
    opened, load = [], megatron_files._torch_load

    def counted_load(path, **kwargs):  # the reader's one loading function, called through: each rank file it loads
        opened.append(str(path))
        return load(path, **kwargs)

    monkeypatch.setattr(megatron_files, "_torch_load", counted_load)
    manifest = from_megatron(legacy, str(tmp_path / "ok"), verify=True, show_progress=False)
    monkeypatch.undo()
    assert manifest["verify"]["max_abs_delta"] < PARITY and manifest["optimizer"]["carried"]
    assert len(opened) == len(set(opened)) == 4, collections.Counter(opened)  # {rank file: times loaded}

    for wrong in (dict(qkv_layout="separate"), dict(fc1_merge="concat")):
        out = tmp_path / f"wrong_{next(iter(wrong.values()))}"
        with pytest.raises(ConversionError, match="differ from the Megatron reference forward"):
            from_megatron(legacy, str(out), verify=True, show_progress=False, **wrong)
        assert_nothing_written(out)
        # and against megatron-core's own logits, the same wrong merge is far off
        from_megatron(legacy, str(out), show_progress=False, **wrong)
        to_hf(str(out), str(tmp_path / "hf_wrong"), show_progress=False)
        assert max_delta_to_megatron(megatron_dir, "tp2pp2", tmp_path / "hf_wrong") > 100 * PARITY
        shutil.rmtree(tmp_path / "hf_wrong")


def test_round_trip_to_megatron_legacy_is_exact(tmp_path, megatron_dir):
    source = megatron_dir / "tp2pp2" / "legacy"
    from_megatron(str(source), str(tmp_path / "ours"), show_progress=False)
    to_megatron(str(tmp_path / "ours"), str(tmp_path / "back"), tp=2, pp=2, show_progress=False)
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "40"
    rank_dirs = sorted(os.listdir(source / "iter_0000040"))
    assert sorted(os.listdir(tmp_path / "back" / "iter_0000040")) == rank_dirs
    for rank in rank_dirs:
        original = torch.load(source / "iter_0000040" / rank / "model_optim_rng.pt", weights_only=False)
        back = torch.load(tmp_path / "back" / "iter_0000040" / rank / "model_optim_rng.pt", weights_only=False)
        weights = {k: v for k, v in original["model"].items() if not k.endswith("_extra_state")}
        assert sorted(back["model"]) == sorted(weights)
        for name, tensor in weights.items():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and rank.startswith("mp_rank_01"):
                # rows 288..575 of 576: real tokens up to 511, then Megatron's padding (written as zeros)
                real = 512 - 288
                assert torch.equal(back["model"][name][:real], tensor[:real]), name
                assert not back["model"][name][real:].any(), name
            else:
                assert torch.equal(back["model"][name], tensor), f"{rank}: {name}"
        assert back["args"].padded_vocab_size == 576 and back["iteration"] == 40


def test_from_torch_with_hf_names_and_with_a_key_map(tmp_path):
    model = make_hf_model(tmp_path / "hf")
    state = model.state_dict()
    torch.save({"model": state, "iteration": 7}, tmp_path / "hf_names.pt")
    manifest = from_torch(str(tmp_path / "hf_names.pt"), str(tmp_path / "a"), str(tmp_path / "hf" / "config.json"),
                          verify=True, show_progress=False)
    assert manifest["verify"]["reference"] == "transformers"
    to_hf(str(tmp_path / "a"), str(tmp_path / "a_hf"), show_progress=False)
    restored = load_file(str(tmp_path / "a_hf" / HF_WEIGHTS_FILE))
    assert all(torch.equal(restored[k], v) for k, v in state.items())

    # Other names (a training script's own module names) through a key map
    renamed = {name.replace("model.layers.", "blocks.").replace("self_attn.", "attn."): tensor
               for name, tensor in state.items()}
    renamed["rope.cache"] = torch.zeros(8)
    torch.save({"state_dict": renamed}, tmp_path / "mine.pt")
    key_map = {"blocks.{n}.attn.{rest}": "model.layers.{n}.self_attn.{rest}",
               "blocks.{n}.{rest}": "model.layers.{n}.{rest}"}
    (tmp_path / "map.yaml").write_text(yaml.safe_dump(key_map))
    with pytest.raises(ConversionError, match=r"rope\.cache: unknown tensor"):
        from_torch(str(tmp_path / "mine.pt"), str(tmp_path / "b"), str(tmp_path / "hf" / "config.json"),
                   str(tmp_path / "map.yaml"), show_progress=False)
    assert_nothing_written(tmp_path / "b")
    (tmp_path / "map.yaml").write_text(yaml.safe_dump({**key_map, "rope.cache": None}))
    manifest = from_torch(str(tmp_path / "mine.pt"), str(tmp_path / "b"), str(tmp_path / "a" / MODEL_SECTION_FILE),
                          str(tmp_path / "map.yaml"), verify=True, show_progress=False)
    assert manifest["ignored"] == ["rope.cache"]
    assert json.loads((tmp_path / "b" / "conversion.json").read_text())["fingerprint"] == \
        json.loads((tmp_path / "a" / "conversion.json").read_text())["fingerprint"]


# --- Meta's original layout (consolidated.NN.pth + params.json) ---------------------------------------------------

META_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight",
              "model.layers.{n}.self_attn.q_proj.weight": "layers.{n}.attention.wq.weight",
              "model.layers.{n}.self_attn.k_proj.weight": "layers.{n}.attention.wk.weight",
              "model.layers.{n}.self_attn.v_proj.weight": "layers.{n}.attention.wv.weight",
              "model.layers.{n}.self_attn.o_proj.weight": "layers.{n}.attention.wo.weight",
              "model.layers.{n}.mlp.gate_proj.weight": "layers.{n}.feed_forward.w1.weight",
              "model.layers.{n}.mlp.down_proj.weight": "layers.{n}.feed_forward.w2.weight",
              "model.layers.{n}.mlp.up_proj.weight": "layers.{n}.feed_forward.w3.weight",
              "model.layers.{n}.input_layernorm.weight": "layers.{n}.attention_norm.weight",
              "model.layers.{n}.post_attention_layernorm.weight": "layers.{n}.ffn_norm.weight"}
# fairscale's model-parallel split of each Meta tensor (ColumnParallel rows, RowParallel columns, Llama 2's
# ParallelEmbedding the hidden dimension); norms are replicated.
META_SPLIT = {"tok_embeddings": 1, "wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0, "output": 0}
META_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def meta_name(hf_name):
    for hf, meta in META_NAMES.items():
        head, _, tail = hf.partition("{n}")
        if tail and hf_name.startswith(head) and hf_name.endswith(tail):
            return meta.format(n=hf_name[len(head):-len(tail)])
        if hf_name == hf:
            return meta


def write_meta_checkpoint(model, directory, shards):
    """model in Meta's layout: q/k rows back in Meta's rotary order, consolidated.NN.pth (torch.save) + params.json.

    The inverse of transformers' convert_llama_weights_to_hf.py permute(w, n_heads) =
    w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).
    """
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads

    def unpermute(w, n_heads):
        return w.view(n_heads, 2, head_dim // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    meta = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("q_proj.weight"):
            tensor = unpermute(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = unpermute(tensor, config.num_key_value_heads)
        meta[meta_name(name)] = tensor.to(torch.bfloat16)  # Meta's releases are bfloat16
    os.makedirs(directory)
    for rank in range(shards):
        shard = {}
        for name, tensor in meta.items():
            split = META_SPLIT.get(name.split(".")[-2])
            shard[name] = tensor.clone() if split is None else tensor.chunk(shards, split)[rank].clone()
        torch.save(shard, os.path.join(directory, f"consolidated.{rank:02d}.pth"))
    params = {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
              "n_kv_heads": config.num_key_value_heads, "multiple_of": 64, "ffn_dim_multiplier": 1.1,
              "norm_eps": config.rms_norm_eps, "vocab_size": -1}
    (directory / "params.json").write_text(json.dumps(params))


def bf16_hf_model(path):
    """A tiny transformers Llama whose weights are bfloat16 values (Meta's dtype), held in float32."""
    model = make_hf_model(path, **META_TINY)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_layout_converts_by_itself_with_transformers_logits(tmp_path, shards):
    """consolidated.NN.pth + params.json: names, shard merge and the rotary row permutation, proven by logits."""
    model = bf16_hf_model(tmp_path / "hf")
    write_meta_checkpoint(model, tmp_path / "meta", shards)
    # intermediate size as Meta's FeedForward computes it: int(1.1 * int(8 * 64 / 3)) = 187, rounded up to 64
    manifest = from_torch(str(tmp_path / "meta" / "consolidated.00.pth"), str(tmp_path / "ours"),
                          str(tmp_path / "meta" / "params.json"), seq_length=64, verify=True, show_progress=False)
    assert manifest["source"]["format"] == "meta" and len(manifest["source"]["files"]) == shards
    assert manifest["model"]["vocab_size"] == 512 and manifest["model"]["intermediate_size"] == 192
    print(f"\n[parity] Meta layout, {shards} shard(s): max |delta| against Meta's forward "
          f"{manifest['verify']['max_abs_delta']:.2e}")

    to_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    restored = load_file(str(tmp_path / "back" / HF_WEIGHTS_FILE))
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored[name], tensor), name
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 32))
    expected = model.eval()(torch.from_numpy(tokens)).logits.double().detach().numpy()
    delta = np.abs(transformers_logits(tmp_path / "back", tokens) - expected).max()
    assert delta <= 1e-4 * max(1.0, np.abs(expected).max())


def test_meta_layout_verify_catches_unpermuted_rotary_rows(tmp_path, monkeypatch):
    """What the README's old --key-map example did (q/k copied in Meta's order) fails --verify."""
    from ascend_llm_recipes.models.conversion import tables

    write_meta_checkpoint(bf16_hf_model(tmp_path / "hf"), tmp_path / "meta", 2)
    for hf_name in ("model.layers.{n}.self_attn.q_proj.weight", "model.layers.{n}.self_attn.k_proj.weight"):
        unpermuted = dataclasses.replace(tables.META_TABLE[hf_name], transform="identity")
        monkeypatch.setitem(tables.META_TABLE, hf_name, unpermuted)
    with pytest.raises(ConversionError, match="converted logits differ from a pure-torch forward after Meta's"):
        from_torch(str(tmp_path / "meta" / "consolidated.00.pth"), str(tmp_path / "out"),
                   str(tmp_path / "meta" / "params.json"), seq_length=64, verify=True, show_progress=False)
    assert_nothing_written(tmp_path / "out")


def test_meta_layout_is_refused_through_a_key_map_and_with_missing_shards_or_scaled_rope(tmp_path, capsys):
    write_meta_checkpoint(bf16_hf_model(tmp_path / "hf"), tmp_path / "meta", 2)
    first, params = tmp_path / "meta" / "consolidated.00.pth", tmp_path / "meta" / "params.json"
    (tmp_path / "map.yaml").write_text(yaml.safe_dump({theirs: ours for ours, theirs in META_NAMES.items()}))
    convert_checkpoint = load_script("convert_checkpoint")
    assert convert_checkpoint.main(["--from-torch", str(first), "--model-config", str(params), "--key-map",
                                    str(tmp_path / "map.yaml"), "--output", str(tmp_path / "out"), "--quiet"]) == 2
    assert "holds Meta's Llama layout" in capsys.readouterr().err
    with pytest.raises(ConversionError, match=r"name the first shard, .*consolidated\.00\.pth; all 2 shards"):
        from_torch(str(tmp_path / "meta" / "consolidated.01.pth"), str(tmp_path / "out"), str(params))
    original = json.loads(params.read_text())
    params.write_text(json.dumps({**original, "use_scaled_rope": True}))
    with pytest.raises(ConversionError, match="use_scaled_rope: true is not supported"):
        from_torch(str(first), str(tmp_path / "out"), str(params))
    params.write_text(json.dumps(original))
    os.rename(tmp_path / "meta" / "consolidated.01.pth", tmp_path / "meta" / "consolidated.02.pth")
    with pytest.raises(ConversionError, match="are not consolidated.00.pth, consolidated.01.pth: a shard is missing"):
        from_torch(str(first), str(tmp_path / "out"), str(params))
    assert_nothing_written(tmp_path / "out")


def test_key_map_value_yaml_reads_as_a_mapping_is_refused_naming_the_file_and_key(tmp_path):
    """`module.{rest}: {rest}` unquoted: YAML reads the value as the mapping {'rest': None}."""
    model = make_hf_model(tmp_path / "hf")
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp.pt")
    key_map = tmp_path / "map.yaml"
    key_map.write_text("module.{rest}: {rest}\n")
    with pytest.raises(ConversionError, match=r"map\.yaml: 1 problem\(s\) in the key map:\n  - module\.\{rest\}: the "
                                              r"value \{'rest': None\} is a YAML mapping, not a name.*quote it: "
                                              r"'module\.\{rest\}': '\{rest\}'"):
        from_torch(str(tmp_path / "ddp.pt"), str(tmp_path / "out"), str(tmp_path / "hf" / "config.json"),
                   str(key_map), show_progress=False)
    assert_nothing_written(tmp_path / "out")
    key_map.write_text("'{x}': 3\n")
    with pytest.raises(ConversionError, match=r"  - \{x\}: the value 3 is not a name"):
        from_torch(str(tmp_path / "ddp.pt"), str(tmp_path / "out"), str(tmp_path / "hf" / "config.json"),
                   str(key_map), show_progress=False)
    key_map.write_text("module.{rest}: '{rest}'\n")
    from_torch(str(tmp_path / "ddp.pt"), str(tmp_path / "out"), str(tmp_path / "hf" / "config.json"),
               str(key_map), show_progress=False)
    assert (tmp_path / "out" / "conversion.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--tp", "0"], "argument --tp: 0 is not a positive integer"),
    (["--pp", "0"], "argument --pp: 0 is not a positive integer"),
    (["--pp", "-1"], "argument --pp: -1 is not a positive integer"),
    (["--iteration", "-5"], "argument --iteration: -5 is not a non-negative integer"),
])
def test_to_megatron_numeric_arguments_are_refused_by_name(tmp_path, capsys, args, message):
    make_hf_model(tmp_path / "hf")
    convert_checkpoint = load_script("convert_checkpoint")
    assert convert_checkpoint.main(["--from-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ours"),
                                    "--quiet"]) == 0
    with pytest.raises(SystemExit) as exit_code:
        convert_checkpoint.main(["--to-megatron", str(tmp_path / "ours"), "--output", str(tmp_path / "m"), *args])
    assert exit_code.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_to_megatron_refuses_layouts_and_iterations_it_cannot_write(tmp_path):
    """Called as a library too: no ZeroDivisionError, no iter_-000005 that --from-megatron would refuse."""
    make_hf_model(tmp_path / "hf")  # 4 heads, 2 KV heads, 2 layers
    from ascend_llm_recipes.models.conversion.hf import from_hf
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), show_progress=False)
    for kwargs, message in ((dict(tp=0), "--tp 0: must be a positive integer"),
                            (dict(pp=-1), "--pp -1: must be a positive integer"),
                            (dict(iteration=-5), "--iteration -5: must be 0 or more"),
                            (dict(tp=4), r"--tp 4 does not divide num_kv_heads \(2\)"),
                            (dict(tp=3), r"--tp 3 does not divide num_heads \(4\)"),
                            (dict(pp=3), r"--pp 3 does not divide num_layers \(2\)")):
        with pytest.raises(ConversionError, match=message):
            to_megatron(str(tmp_path / "ours"), str(tmp_path / "m"), show_progress=False, **kwargs)
        assert_nothing_written(tmp_path / "m")
    to_megatron(str(tmp_path / "ours"), str(tmp_path / "m"), iteration=5, show_progress=False)
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert from_megatron(str(tmp_path / "m"), str(tmp_path / "again"), show_progress=False)["source"]["iteration"] == 5


def _rewrite_args(src, dst, **changes):
    """A copy of a legacy TP1 checkpoint whose saved args say something else."""
    state = torch.load(src / "iter_0000040" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    for key, value in changes.items():
        if value is None:
            delattr(state["args"], key)
        else:
            setattr(state["args"], key, value)
    os.makedirs(dst / "iter_0000040" / "mp_rank_00")
    torch.save(state, dst / "iter_0000040" / "mp_rank_00" / "model_optim_rng.pt")
    return dst / "iter_0000040"


@pytest.mark.parametrize("arg, value", [("rotary_percent", 0.5), ("normalization", "LayerNorm"), ("swiglu", False),
                                        ("multi_latent_attention", True), ("add_bias_linear", True)])
def test_unsupported_args_are_refused_by_name(tmp_path, megatron_dir, arg, value):
    ckpt = _rewrite_args(megatron_dir / "tp1" / "legacy", tmp_path / "ckpt", **{arg: value})
    with pytest.raises(ConversionError, match=f"{arg}: {value!r} is not supported"):
        from_megatron(str(ckpt), str(tmp_path / "out"), show_progress=False)
    assert_nothing_written(tmp_path / "out")


def test_vocabulary_size_comes_from_args_or_the_command_line(tmp_path, megatron_dir):
    ckpt = _rewrite_args(megatron_dir / "tp1" / "legacy", tmp_path / "ckpt", vocab_size=None)
    with pytest.raises(ConversionError, match="vocab_size: not recorded.*pass --vocab-size"):
        from_megatron(str(ckpt), str(tmp_path / "out"), show_progress=False)
    assert from_megatron(str(ckpt), str(tmp_path / "out"), vocab_size=500,
                         show_progress=False)["model"]["vocab_size"] == 500


def test_write_recipe_continues_the_run_and_plans(tmp_path, megatron_dir):
    from_megatron(str(megatron_dir / "tp2pp2" / "torch_dist"), str(tmp_path / "ours"), show_progress=False)
    written = write_recipe(str(tmp_path / "recipes" / "continued.yaml"), str(tmp_path / "ours"), devices=8)
    recipe = load_recipe(written["path"], planning=True)  # the strict loader, as --plan uses it
    p = recipe.parallel_config
    assert (p.data_parallel, p.model_parallel, p.pipeline_stage, p.micro_batch_num) == (2, 2, 2, 4)
    assert recipe.global_batch_size == 16 and recipe.runner_config.batch_size == 2
    assert recipe.runner_config.stop_step == 1000 - 40
    assert (recipe.optimizer.betas, recipe.optimizer.weight_decay) == ([0.9, 0.95], 0.05)
    assert recipe.lr_schedule.type == "CosineWithWarmUpLR" and recipe.lr_schedule.lr_end == 3e-5
    s = recipe.lr_schedule  # Megatron's whole schedule, entered at iteration 40 (no optimizer state in torch_dist)
    assert (s.learning_rate, s.warmup_steps, s.total_steps, s.start_step) == (3e-4, 10, 1000, 40)
    assert not recipe.load_optimizer_state
    assert recipe.model.model_config.num_kv_heads == 2 and recipe.load_checkpoint == str(tmp_path / "ours")
    assert plan(recipe).fits
    with pytest.raises(ConversionError, match="--devices 3: no layout keeps the run's global batch 16"):
        write_recipe(str(tmp_path / "recipes" / "three.yaml"), str(tmp_path / "ours"), devices=3)
    assert not (tmp_path / "recipes" / "three.yaml").exists()


@pytest.fixture(scope="module")
def continued_run(tmp_path_factory, megatron_dir, tiny_dataset):
    """The TP2xPP2 legacy fixture converted with its Adam moments, then 2 steps of the tiny recipe from it (a
    checkpoint each step): one launch read by the training tests below. (converted dir, run dir)."""
    root = tmp_path_factory.mktemp("continued")
    ours, run_dir = root / "ours", root / "run"
    from_megatron(str(megatron_dir / "tp2pp2" / "legacy"), str(ours), show_progress=False)
    model_config = yaml.safe_load((ours / MODEL_SECTION_FILE).read_text())["model"]["model_config"]
    overrides = [f"model.model_config.{key}={json.dumps(value)}" for key, value in model_config.items()]
    code = launch(TINY_RECIPE, [f"output_dir={run_dir}", f"train_dataset.data_loader.dataset_dir={tiny_dataset}",
                                f"load_checkpoint={ours}", "load_ckpt_format=safetensors",
                                f"load_optimizer_state={ours}", "runner_config.stop_step=2",
                                "lr_schedule.warmup_steps=0",
                                "callbacks.1.save_checkpoint_steps=1", "optimizer.betas=[0.9, 0.95]",
                                *overrides], show_progress=False)
    assert code == 0
    return ours, run_dir


def test_converted_fixture_trains_and_exports(tmp_path, megatron_dir, continued_run, capsys):
    """Done-when, for TP2xPP2 torch_dist: convert (CLI), train 2 steps with the tiny recipe, export --to-hf.

    The run trained is continued_run's: it starts from the legacy files of the same checkpoint, whose conversion is
    this one's, byte for byte (its Adam moments aside).
    """
    convert_checkpoint = load_script("convert_checkpoint")
    ours, (trained_from, run_dir) = tmp_path / "ours", continued_run
    assert convert_checkpoint.main(["--from-megatron", str(megatron_dir / "tp2pp2" / "torch_dist"),
                                    "--output", str(ours), "--quiet"]) == 0
    assert "Megatron iteration 40" in capsys.readouterr().out
    assert convert_checkpoint.main(["--from-megatron", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")]) == 2
    assert "nowhere: not a directory" in capsys.readouterr().err
    assert (ours / CHECKPOINT_FILE).read_bytes() == (trained_from / CHECKPOINT_FILE).read_bytes()
    assert yaml.safe_load((ours / MODEL_SECTION_FILE).read_text()) == \
        yaml.safe_load((trained_from / MODEL_SECTION_FILE).read_text())

    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 2 and all(np.isfinite(losses))
    to_hf(str(run_dir), str(tmp_path / "hf"), show_progress=False)
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.num_hidden_layers == 4


def test_adam_moments_of_legacy_files_are_carried_over(tmp_path, megatron_dir):
    """Each rank's moments, found by index in optimizer.state_dict(), are the live optimizer's for that parameter."""
    from ascend_llm_recipes.models.conversion.ours import MOMENT_FILES
    from ascend_llm_recipes.models.conversion.megatron_files import open_megatron
    from ascend_llm_recipes.models.conversion.tables import MEGATRON_TENSORS

    manifest = from_megatron(str(megatron_dir / "tp2pp2" / "legacy"), str(tmp_path / "ours"), show_progress=False)
    assert manifest["optimizer"]["carried"] and manifest["optimizer"]["global_step"] == 2  # steps taken, not 40
    with open_megatron(str(megatron_dir / "tp2pp2" / "legacy")) as ckpt:
        for t in range(2):
            for p in range(2):
                truth = torch.load(megatron_dir / "tp2pp2" / f"moments_{t:02d}_{p:03d}.pt")
                for index, key in enumerate(MOMENT_FILES.values()):
                    view = ckpt.moments(key)
                    for ours in ("q_proj", "gate_proj", "o_proj", "down_proj", "input_layernorm"):
                        kind = next(k for k, tensor in MEGATRON_TENSORS.items() if ours in tensor.rows[0].ours)
                        stage, name = view.find(kind, 2 * p)
                        assert torch.equal(torch.from_numpy(view.shard(kind, 2 * p, t)), truth[name][index]), name
    moments = load_file(str(tmp_path / "ours" / "optimizer" / "adam_m.safetensors"))
    weights = load_file(str(tmp_path / "ours" / "weights.safetensors"))
    assert sorted(moments) == sorted(weights) and all(moments[n].shape == weights[n].shape for n in weights)
    restarted = from_megatron(str(megatron_dir / "tp2pp2" / "torch_dist"), str(tmp_path / "dist"),
                              show_progress=False)["optimizer"]
    assert not restarted["carried"] and "restarts the optimizer" in restarted["note"]
    assert not (tmp_path / "dist" / "optimizer").exists()


def test_training_continues_with_the_carried_moments(continued_run):
    """The first step starts from Megatron's moments and step: m1 = b1 m0 + (1 - b1) g, v1 = b2 v0 + (1 - b2) g^2."""
    import mindspore as ms

    ours, run_dir = continued_run
    rank0 = os.path.join(step_dir(str(run_dir), 1), "rank_0")
    saved = ms.load_checkpoint(next(os.path.join(rank0, f) for f in sorted(os.listdir(rank0)) if f.endswith(".ckpt")))
    assert int(saved["global_step"].asnumpy()[0]) == 3  # Megatron's 2 steps, then this one
    m0 = load_file(str(ours / "optimizer" / "adam_m.safetensors"))
    v0 = load_file(str(ours / "optimizer" / "adam_v.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.norm.weight"):
        m_old, v_old = m0[name].double().numpy(), v0[name].double().numpy()
        m_new, v_new = (saved[f"{k}.{name}"].asnumpy().astype(np.float64) for k in ("adam_m", "adam_v"))
        grad = (m_new - 0.9 * m_old) / 0.1
        assert np.abs(v_old).max() > 0
        np.testing.assert_allclose(v_new, 0.95 * v_old + 0.05 * grad ** 2, rtol=1e-3, atol=1e-3 * np.abs(v_new).max())


@pytest.mark.parametrize("style, iteration", [("cosine", 40), ("linear", 40), ("cosine", 5), ("linear", 5)])
def test_continued_lr_schedule_equals_megatrons(tmp_path, megatron_dir, style, iteration):
    """--write-recipe's LR at each step equals megatron-core's OptimizerParamScheduler at iteration N + 1, N + 2, ..."""
    import mindspore as ms
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from mindformers import MindFormerConfig
    from mindformers.core.lr import build_lr
    import ascend_llm_recipes.training.worker.optim  # noqa: F401  (registers StartStepLR)
    from ascend_llm_recipes.training.worker.train import mindformers_config

    ours = tmp_path / "ours"
    from_megatron(str(megatron_dir / "tp1" / "legacy"), str(ours), show_progress=False)  # carries Adam step 2
    manifest = json.loads((ours / "conversion.json").read_text())
    manifest["source"]["megatron_args"]["lr_decay_style"] = style  # the same run, had it used another style
    manifest["source"]["iteration"] = iteration
    (ours / "conversion.json").write_text(json.dumps(manifest))
    written = write_recipe(str(tmp_path / "continued.yaml"), str(ours), devices=8)  # DP 8: moments load
    recipe = load_recipe(written["path"], planning=True)
    assert recipe.load_optimizer_state == str(ours) and recipe.lr_schedule.start_step == iteration - 2
    schedule = build_lr(MindFormerConfig(**mindformers_config(recipe, str(tmp_path / "run"))).lr_schedule)

    args, batch = manifest["source"]["megatron_args"], 16
    megatron = OptimizerParamScheduler(
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)]), init_lr=0.0, max_lr=args["lr"],
        min_lr=args["min_lr"], lr_warmup_steps=args["lr_warmup_iters"] * batch,
        lr_decay_steps=args["lr_decay_iters"] * batch, lr_decay_style=style, start_wd=0.05, end_wd=0.05,
        wd_incr_steps=args["train_iters"] * batch, wd_incr_style="constant")
    megatron.step(increment=iteration * batch)  # where the saved run stopped
    for step in range(2, 2 + 1000):  # the optimizer step carried over, then on
        expected = megatron.optimizer.param_groups[0]["lr"]  # what Megatron's iteration N + 1 + (step - 2) uses
        if step - 2 in (0, 1, 2, 3, 7, 500, 960 - iteration, 990 - iteration):
            assert float(schedule(ms.Tensor(step, ms.int32)).asnumpy()) == pytest.approx(expected, rel=1e-5,
                                                                                         abs=1e-9), step
        megatron.step(increment=batch)


def test_each_format_table_has_a_row_for_every_tensor_and_a_tensor_without_one_is_named():
    """A tensor added to models/shapes.py must get a row in each format's table: the tables are the whole mapping."""
    from ascend_llm_recipes.models.conversion.tables import HF_TABLE, MEGATRON_TABLE, META_TABLE, row_for
    from ascend_llm_recipes.models.shapes import TENSORS

    ours = {pattern for pattern, _, _ in TENSORS}
    assert set(HF_TABLE) == ours and set(MEGATRON_TABLE) == ours
    # Meta's Llama: no bias, no per-head norms, no experts
    assert set(META_TABLE) == {pattern for pattern, _, flag in TENSORS
                               if flag in (None, "untied", "dense_mlp", "q_proj", "kv_proj")}
    row, numbers = row_for(MEGATRON_TABLE, "model.layers.3.self_attn.k_proj.bias", "ckpt")
    assert (row.theirs[0], row.part, numbers) == ("decoder.layers.{n}.self_attention.linear_qkv.bias", "k", {"n": 3})
    row, numbers = row_for(MEGATRON_TABLE, "model.layers.1.mlp.experts.5.up_proj.weight", "ckpt")
    assert (row.theirs[0], row.part, numbers) == (
        "decoder.layers.{n}.mlp.experts.local_experts.{e}.linear_fc1.weight", "up", {"n": 1, "e": 5})
    with pytest.raises(ConversionError, match=r"(?s)ckpt: model\.layers\.0\.self_attn\.q_norm\.weight: no row .*"
                                              r"HINT.*needs a row in each format's table"):
        row_for(META_TABLE, "model.layers.0.self_attn.q_norm.weight", "ckpt")


@pytest.mark.parametrize("ours", ["model.layers.{n}.self_attn.q_proj.weight", "model.layers.{n}.self_attn.q_proj.bias",
                                  "model.layers.{n}.mlp.gate_proj.weight", "model.layers.{n}.self_attn.o_proj.weight"])
def test_rank_shares_of_a_fused_tensor_join_back_and_unfuse_into_its_rows(ours):
    """Writing (rank_share) and reading (join_ranks, the FUSE split) are one table read both ways, at TP 1, 2, 4."""
    from ascend_llm_recipes.models.conversion.tables import (FUSE, MEGATRON_TABLE, MEGATRON_TENSORS, join_ranks,
                                                             megatron_name, rank_share)

    groups, head_dim, heads, hidden = 4, 8, 8, 64  # 2 query heads per KV group
    rows = {"q": heads * head_dim, "k": groups * head_dim, "v": groups * head_dim, "gate": 96, "up": 96, None: hidden}
    tensor = MEGATRON_TENSORS[megatron_name(ours)]
    rng = np.random.default_rng(0)
    bias = MEGATRON_TABLE[ours].ours.endswith("bias")
    parts = [rng.standard_normal((rows[row.part],) if bias else (rows[row.part], hidden)) for row in tensor.rows]
    whole = FUSE[tensor.fuse][0](parts, groups, head_dim) if tensor.fuse else parts[0]
    for tp in (1, 2, 4):
        shares = [rank_share(tensor, parts, t, tp, groups, head_dim) for t in range(tp)]
        assert np.array_equal(join_ranks(tensor, shares, groups, head_dim), whole), tp
    if tensor.fuse:
        unfused = FUSE[tensor.fuse][1](whole, groups, head_dim)
        assert all(np.array_equal(unfused[row.part], part) for row, part in zip(tensor.rows, parts))
