"""Megatron-core Mixture-of-Experts checkpoints -> ours, proven on legacy files written by real megatron-core.

The fixtures (conftest.py megatron_dir, tests/make_megatron_fixtures.py) are megatron-core's GPTModel with its
MoELayer (SequentialMLP local experts, allgather dispatcher) run on CPU: `moe` at TP1 (first layer dense, softmax
router, shared expert with gate, qk_layernorm, kv_channels 24 != hidden / heads, expert capacity 0.75) and
`moe_ep2` with the experts split over 2 expert-parallel ranks (mp_rank_00_000, mp_rank_00_001; sigmoid router
with expert_bias, shared expert without gate), and `moe_tp2ep2` (TP2 x EP2: mp_rank_TT_EEE; pre-softmax top k,
every other layer dense, no shared expert), saved as legacy files and torch_dist, each with megatron-core's own
logits on fixed tokens; and each again as megatron-core's GroupedMLP (--moe-grouped-gemm: weight1/weight2) holding
the same weights, whose forward needs CUDA kernels: the SequentialMLP's logits are its reference. Written back
(to_megatron, --ep, --grouped-gemm), they are megatron-core's files again.
"""

import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from ascend_llm_recipes.common.errors import ConversionError
from ascend_llm_recipes.models.conversion import megatron_files
from ascend_llm_recipes.models.conversion.megatron import from_megatron, model_config_from_args
from ascend_llm_recipes.models.conversion.ours import CHECKPOINT_FILE, MODEL_SECTION_FILE
from ascend_llm_recipes.models.conversion.verify import verify_against
from ascend_llm_recipes.training.tools.export import to_megatron
from conftest import load_script
from test_convert import assert_nothing_written

MOE_LAYOUTS = ("moe", "moe_ep2", "moe_tp2ep2")
PARALLEL = {"moe": (1, 1), "moe_ep2": (1, 2), "moe_tp2ep2": (2, 2)}  # (TP, EP)
EXPECTED = {  # what each fixture's Megatron-LM arguments become in our model_config
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, dense_layers=[0], head_dim=24,
                qk_norm=True, shared_expert_intermediate_size=48, shared_expert_gate=True, router_score="softmax",
                norm_topk_prob=True, expert_bias=False, tie_word_embeddings=True, capacity_factor=0.75,
                token_drop_policy="probs"),
    "moe_ep2": dict(num_experts=4, dense_layers=[], head_dim=None, qk_norm=False, shared_expert_intermediate_size=48,
                    shared_expert_gate=False, router_score="sigmoid", norm_topk_prob=True, expert_bias=True,
                    tie_word_embeddings=False),
    "moe_tp2ep2": dict(dense_layers=[1, 3], qk_norm=True, shared_expert_intermediate_size=0, router_score="softmax",
                       norm_topk_prob=False, expert_bias=False),
}


def layer_pattern(freq, layers: int = 4) -> list:
    """Megatron-LM's moe_layer_freq (N: every N-th layer has experts, or a 0/1 list) as its 0/1 list."""
    return [int(n % freq == 0) for n in range(layers)] if isinstance(freq, int) else list(freq)


def against_megatron_cores_logits(megatron_dir, layout, converted_dir) -> dict:
    """Our converted model's logits against megatron-core's own on its fixture tokens (convert's PARITY_RULE)."""
    tokens, logits = (np.load(megatron_dir / layout / f"{name}.npy") for name in ("tokens", "logits"))

    def megatron_core(asked):  # verify_against draws (2, 16) tokens from seed 0: the fixture's own
        assert np.array_equal(asked, tokens)
        return logits

    return verify_against(megatron_core, str(converted_dir), layout, name="megatron-core", batch=tokens.shape[0],
                          max_tokens=tokens.shape[1])


@pytest.fixture(scope="module")
def converted(megatron_dir, tmp_path_factory):
    """{layout: (manifest, directory)} of the legacy files, {(layout, "torch_dist"): ...} of the torch_dist ones:
    each MoE fixture converted once, with --verify."""
    out = tmp_path_factory.mktemp("moe_converted")
    made = {}
    for layout in MOE_LAYOUTS:
        for fmt, key in (("legacy", layout), ("torch_dist", (layout, "torch_dist"))):
            made[key] = (from_megatron(str(megatron_dir / layout / fmt), str(out / layout / fmt), verify=True,
                                       show_progress=False), out / layout / fmt)
    return made


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_logits_equal_megatron_cores(megatron_dir, converted, layout):
    """Megatron MoE (legacy, every expert-parallel rank; torch_dist) -> ours gives megatron-core's logits on the
    same tokens."""
    manifest, out = converted[layout]
    assert manifest["verify"]["reference"] == "a pure-torch Megatron forward"
    assert (manifest["source"]["tensor_model_parallel_size"],
            manifest["source"]["expert_model_parallel_size"]) == PARALLEL[layout]
    assert not manifest["optimizer"]["carried"] and "MoE" in manifest["optimizer"]["note"]
    model = yaml.safe_load((out / MODEL_SECTION_FILE).read_text())["model"]["model_config"]
    assert {key: model.get(key) for key in EXPECTED[layout]} == EXPECTED[layout]
    result = against_megatron_cores_logits(megatron_dir, layout, out)
    print(f"\n[parity] {layout}: max |delta logits| vs megatron-core {result['max_abs_delta']:.2e}")
    # megatron-core's torch_dist save of the same model (experts on an axis; layer by layer when layers differ,
    # stacked when they do not) converts to the same tensors
    manifest, dist_out = converted[layout, "torch_dist"]
    assert manifest["source"]["format"] == "megatron-torch_dist" and manifest["verify"]["max_abs_delta"] < 1e-4
    legacy, dist = (load_file(str(d / CHECKPOINT_FILE)) for d in (out, dist_out))
    assert sorted(legacy) == sorted(dist) and all(torch.equal(legacy[k], dist[k]) for k in legacy)


def test_expert_parallel_ranks_are_read_by_global_expert(megatron_dir, tmp_path, monkeypatch):
    """Reading each expert-parallel rank's local experts as if they were global (expert e of every rank from rank 0)
    converts without complaint; megatron-core's logits catch it (the pure-torch reference reads the files the same
    way, so --verify alone cannot)."""
    monkeypatch.setattr(megatron_files.LegacyCheckpoint, "expert_location",
                        lambda self, expert: (0, None if expert is None else expert % 2))
    from_megatron(str(megatron_dir / "moe_ep2" / "legacy"), str(tmp_path / "wrong"), show_progress=False)
    with pytest.raises(ConversionError, match="differ from megatron-core"):
        against_megatron_cores_logits(megatron_dir, "moe_ep2", tmp_path / "wrong")


def test_moe_arguments_megatron_computes_differently_are_refused_by_name(megatron_dir):
    with megatron_files.open_megatron(str(megatron_dir / "moe" / "legacy")) as ckpt:
        args = dict(ckpt.args)
    refused = dict(moe_router_num_groups=2, moe_token_drop_policy="tokens", moe_router_load_balancing_type="sinkhorn",
                   moe_router_enable_expert_bias=True, expert_tensor_parallel_size=2, moe_layer_freq="([0]*1+[1]*3)",
                   moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ConversionError, match="7 problem") as error:
        model_config_from_args({**args, **refused}, "moe (args)")
    for key in refused:
        assert f"  - {key}: " in error.value.message, key
    assert "softmax score function" in error.value.message  # expert_bias without sigmoid scores
    # moe_router_pre_softmax: the top k of the softmax, not renormalised
    assert not model_config_from_args({**args, "moe_router_pre_softmax": True}, "moe").norm_topk_prob


def test_load_balancing_types_map_to_the_scope_and_the_rest_is_noted(megatron_dir):
    """aux_loss and global_aux_loss are router_aux_loss_scope micro_batch and global, with the coefficient; the
    per-sequence seq_aux_loss is not ours: coefficient 0, said in the conversion's notes."""
    from ascend_llm_recipes.models.conversion.megatron import balancing_notes

    with megatron_files.open_megatron(str(megatron_dir / "moe" / "legacy")) as ckpt:
        args = {**ckpt.args, "moe_aux_loss_coeff": 0.01}
    for kind, scope in (("aux_loss", "micro_batch"), ("global_aux_loss", "global")):
        cfg = model_config_from_args({**args, "moe_router_load_balancing_type": kind}, "moe")
        assert (cfg.router_aux_loss_coef, cfg.router_aux_loss_scope) == (0.01, scope)
        assert balancing_notes({**args, "moe_router_load_balancing_type": kind}) == []
    sequence = {**args, "moe_router_load_balancing_type": "seq_aux_loss"}
    assert model_config_from_args(sequence, "moe").router_aux_loss_coef == 0.0
    [note] = balancing_notes(sequence)
    assert "'seq_aux_loss' with moe_aux_loss_coeff 0.01" in note and "router_aux_loss_coef is 0" in note


@pytest.mark.parametrize("capacity, policy, pad, expected", [
    (1.25, "position", True, (1.25, "position")),  # padding with weight-0 tokens: the same numbers
    (None, "position", False, (0.0, "probs")),      # no capacity: the policy picks nothing
    (-1.0, "probs", False, (0.0, "probs")),         # megatron-core reads a negative capacity as none
])
def test_expert_capacity_arguments_are_carried(megatron_dir, capacity, policy, pad, expected):
    with megatron_files.open_megatron(str(megatron_dir / "moe" / "legacy")) as ckpt:
        args = dict(ckpt.args)
    cfg = model_config_from_args({**args, "moe_expert_capacity_factor": capacity, "moe_token_drop_policy": policy,
                                  "moe_pad_expert_input_to_capacity": pad}, "moe")
    assert (cfg.capacity_factor, cfg.token_drop_policy) == expected
    with pytest.raises(ConversionError, match="moe_expert_capacity_factor: 0 makes megatron-core drop every "
                                              "assignment; ours is dropless"):
        model_config_from_args({**args, "moe_expert_capacity_factor": 0.0}, "moe")


def test_the_expert_capacity_changes_the_moe_fixtures_logits(megatron_dir, converted, tmp_path):
    """The `moe` fixture drops assignments: its conversion read as dropless misses megatron-core's logits."""
    dropless = tmp_path / "dropless"
    shutil.copytree(converted["moe"][1], dropless)
    section = yaml.safe_load((dropless / MODEL_SECTION_FILE).read_text())
    assert section["model"]["model_config"].pop("capacity_factor") == 0.75
    (dropless / MODEL_SECTION_FILE).write_text(yaml.safe_dump(section))
    with pytest.raises(ConversionError, match="differ from megatron-core"):
        against_megatron_cores_logits(megatron_dir, "moe", dropless)


def test_a_missing_expert_parallel_rank_is_refused(megatron_dir, tmp_path):
    legacy = tmp_path / "legacy"
    shutil.copytree(megatron_dir / "moe_ep2" / "legacy", legacy)
    shutil.rmtree(legacy / "iter_0000040" / "mp_rank_00_001")
    with pytest.raises(ConversionError, match=r"mp_rank_00_001/model_optim_rng.pt for tensor_model_parallel_size 1 "
                                              r"x pipeline_model_parallel_size 1 x expert_model_parallel_size 2"):
        from_megatron(str(legacy), str(tmp_path / "out"), show_progress=False)
    assert_nothing_written(tmp_path / "out")


def rank_files_equal(source, back_dir, tp: int) -> list:
    """Every rank file written in back_dir holds the tensors of source's (megatron-core's own) file, none more; only
    the vocabulary's padding rows may differ (576 padded rows split over TP: the real 512 written, the padding
    ones zeros). [(original, written)] per rank, for the callers' own checks of the args."""
    assert sorted(os.listdir(back_dir)) == sorted(os.listdir(source))
    pairs = []
    for rank in sorted(os.listdir(source)):
        original = torch.load(source / rank / "model_optim_rng.pt", weights_only=False)
        back = torch.load(back_dir / rank / "model_optim_rng.pt", weights_only=False)
        weights = {k: v for k, v in original["model"].items() if not k.endswith("_extra_state")}
        assert sorted(back["model"]) == sorted(weights), rank
        for name, tensor in weights.items():
            rows = 512 - 576 // tp * int(rank[8:10]) if name.startswith(("embedding.", "output_layer.")) else None
            assert torch.equal(back["model"][name][:rows], tensor[:rows]), f"{rank}: {name}"
        pairs.append((original, back))
    return pairs


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_round_trip_to_megatron_legacy_is_exact(megatron_dir, converted, tmp_path, layout):
    """ours -> Megatron legacy files equal to megatron-core's own, rank file by rank file (experts, router,
    expert_bias, shared experts, q/k norms); only the vocabulary's padding rows are written as zeros."""
    source = megatron_dir / layout / "legacy" / "iter_0000040"
    tp, ep = PARALLEL[layout]
    to_megatron(str(converted[layout][1]), str(tmp_path / "back"), tp=tp, ep=ep, show_progress=False)
    for original, back in rank_files_equal(source, tmp_path / "back" / "iter_0000040", tp):
        assert layer_pattern(back["args"].moe_layer_freq) == layer_pattern(original["args"].moe_layer_freq)
        for key in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "kv_channels", "moe_router_pre_softmax",
                    "qk_layernorm", "moe_shared_expert_gate", "moe_router_score_function",
                    "moe_router_enable_expert_bias", "expert_model_parallel_size", "moe_expert_capacity_factor",
                    "moe_token_drop_policy"):
            assert getattr(back["args"], key) == getattr(original["args"], key), key
    with pytest.raises(ConversionError, match=r"--ep 3 does not divide num_experts \(4\)"):
        to_megatron(str(converted[layout][1]), str(tmp_path / "bad"), ep=3, show_progress=False)
    assert_nothing_written(tmp_path / "bad")


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_grouped_gemm_experts_convert_to_the_sequential_ones(megatron_dir, converted, tmp_path, layout):
    """megatron-core's GroupedMLP save of each MoE fixture (legacy files: a layer's local experts in weight1/weight2 of
    each TP x EP rank; torch_dist: SequentialMLP's per-expert keys) converts to the tensors of its SequentialMLP save,
    and gives megatron-core's logits (of the SequentialMLP holding the same weights)."""
    sequential = load_file(str(converted[layout][1] / CHECKPOINT_FILE))
    with megatron_files.open_megatron(str(megatron_dir / layout / "grouped" / "legacy")) as ckpt:
        assert ckpt.args["moe_grouped_gemm"] and any(n.endswith(".mlp.experts.weight1") for n in ckpt.index[0, 0, 0])
    for fmt in ("legacy", "torch_dist"):
        manifest = from_megatron(str(megatron_dir / layout / "grouped" / fmt), str(tmp_path / fmt),
                                 verify=fmt == "legacy", show_progress=False)
        grouped = load_file(str(tmp_path / fmt / CHECKPOINT_FILE))
        assert sorted(grouped) == sorted(sequential) and all(torch.equal(grouped[k], sequential[k]) for k in grouped)
    assert manifest["source"]["megatron_args"]["moe_grouped_gemm"] is True
    against_megatron_cores_logits(megatron_dir, layout, tmp_path / "legacy")


@pytest.mark.parametrize("layout", ("moe", "moe_tp2ep2"))
def test_grouped_gemm_round_trip_to_megatron_legacy_is_exact(megatron_dir, converted, tmp_path, layout):
    """ours -> Megatron legacy files with --grouped-gemm equal megatron-core's GroupedMLP files, rank file by rank file
    (weight1/weight2 of every TP x EP rank)."""
    source = megatron_dir / layout / "grouped" / "legacy" / "iter_0000040"
    tp, ep = PARALLEL[layout]
    convert = load_script("convert_checkpoint").main
    assert convert(["--to-megatron", str(converted[layout][1]), "--output", str(tmp_path / "back"), "--tp", str(tp),
                    "--ep", str(ep), "--grouped-gemm", "--quiet"]) == 0
    for _, back in rank_files_equal(source, tmp_path / "back" / "iter_0000040", tp):
        assert back["args"].moe_grouped_gemm is True
    with pytest.raises(SystemExit):  # GroupedMLP files are read as they are: the flag only writes
        convert(["--from-megatron", str(source), "--output", str(tmp_path / "in"), "--grouped-gemm"])
    assert_nothing_written(tmp_path / "in")


def test_transformer_engine_grouped_experts_in_legacy_files_are_refused_by_name(megatron_dir):
    """TEGroupedMLP's legacy names (linear_fc1.weight0..N) cannot be written here (no TransformerEngine): a rank
    file index holding one is refused, naming the layout and the torch_dist route."""
    with megatron_files.open_megatron(str(megatron_dir / "moe" / "grouped" / "legacy")) as ckpt:
        ckpt.index[0, 0, 0]["decoder.layers.1.mlp.experts.linear_fc1.weight3"] = (64, 64)
        with pytest.raises(ConversionError, match=r"mp_rank_00/model_optim_rng.pt: decoder.layers.1.mlp.experts."
                                                  r"linear_fc1.weight3: TransformerEngine's grouped-GEMM experts "
                                                  r"\(TEGroupedMLP") as error:
            ckpt._refuse_te_grouped_experts()
    assert "--ckpt-convert-format torch_dist" in error.value.hint


def test_a_stacked_conversion_verifies_against_the_megatron_forward(megatron_dir, tmp_path):
    """--from-megatron --expert-layout stacked: our CPU model reads the stacked experts back for --verify."""
    out = tmp_path / "stacked"
    manifest = from_megatron(str(megatron_dir / "moe_tp2ep2" / "legacy"), str(out), verify=True, show_progress=False,
                             expert_layout="stacked")
    weights = load_file(str(out / CHECKPOINT_FILE))
    assert manifest["expert_layout"] == "stacked" and manifest["verify"]["reference"] == "a pure-torch Megatron forward"
    assert {"model.layers.0.mlp.experts.weight1", "model.layers.0.mlp.router.weight"} <= weights.keys()
    assert not any(".experts.0." in name for name in weights)


def test_a_checkpoint_without_training_arguments_keeps_the_recipes_schedule(megatron_dir, tmp_path):
    """Megatron files with model arguments only (as --to-megatron writes them: no lr) still give a recipe: the LR
    schedule stays the base recipe's, said in a note (it raised KeyError 'lr')."""
    from ascend_llm_recipes.training.tools.export import _continue_megatron_run

    with megatron_files.open_megatron(str(megatron_dir / "moe" / "legacy")) as ckpt:
        args = {k: v for k, v in ckpt.args.items() if k != "lr"}
    cfg = model_config_from_args(args, "moe")
    data = {}
    notes = _continue_megatron_run(data, args, 0, 8, cfg, str(tmp_path), {})
    assert "lr_schedule" not in data and any(n.startswith("LR: the checkpoint's arguments have no lr") for n in notes)
