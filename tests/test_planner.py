"""Memory and step-time planner: hand-computed sizes, the real CPU allocation, and sanity checks."""

import os

import pytest

from conftest import DEMO_RECIPE, REPO_ROOT, TINY_RECIPE
from ascend_llm_recipes.common.errors import PretrainError
from ascend_llm_recipes.models.arithmetic import flops_per_token, param_count
from ascend_llm_recipes.training.tools.devices import DEVICES, GB
from ascend_llm_recipes.training.tools.plan_report import format_plan
from ascend_llm_recipes.training.tools.planner import (layer_activation_bytes, plan, recompute_working_bytes,
                                                       stage_memory, stage_parameters)
from ascend_llm_recipes.training.recipe.loading import load_recipe

SMALL = ("model.model_config.vocab_size=100", "model.model_config.hidden_size=64",
         "model.model_config.num_layers=2", "model.model_config.num_heads=4", "model.model_config.num_kv_heads=2",
         "model.model_config.intermediate_size=64", "model.model_config.seq_length=32", "runner_config.batch_size=2")
ASCEND = ("context.device_target=Ascend", "use_parallel=True", "parallel.parallel_mode=1", "parallel.full_batch=True",
          "parallel.gradients_mean=False")
LLAMA2_7B = ASCEND + (
    "model.model_config.vocab_size=32000", "model.model_config.hidden_size=4096", "model.model_config.num_layers=32",
    "model.model_config.num_heads=32", "model.model_config.num_kv_heads=32",
    "model.model_config.intermediate_size=11008", "model.model_config.seq_length=4096",
    "model.model_config.compute_dtype=bfloat16", "runner_config.batch_size=1")


def recipe(*overrides, path=TINY_RECIPE):
    return load_recipe(path, tuple(overrides))


def test_moe_plan_states_total_and_active_parameters():
    import os

    p = plan(recipe(path=os.path.join(os.path.dirname(TINY_RECIPE), "tiny_moe_cpu.yaml")), device="CPU")
    # tiny_moe_cpu.yaml's header: 2 of the MoE layer's 4 experts of 3 x 64 x 48 are idle for each token
    assert (p.parameters, p.active_parameters) == (161_408, 161_408 - 2 * 3 * 64 * 48)
    assert format_plan(p).startswith("plan: 161,408 parameters (142,976 active per token) on DP 1 x TP 1 x PP 1")
    assert format_plan(plan(recipe(), device="CPU")).startswith("plan: 158,016 parameters on DP 1")  # dense


def test_hand_computed_small_model():
    p = plan(recipe(*SMALL), device="CPU")
    # Per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate/up/down 3 x 64x64 + two norms 2x64 = 24,704.
    # Tables: vocabulary 100 padded to 112 rows x 64, embedding + untied lm_head. Final norm 64.
    params = 2 * 24_704 + 2 * 112 * 64 + 64
    assert params == 63_808 == p.parameters == p.stage_parameters
    assert p.bytes_of("weights") == 4 * params == 255_232
    assert p.bytes_of("gradients") == 255_232            # no accumulation: every gradient alive for the clip
    assert p.bytes_of("moments") == 8 * params == 510_464
    assert p.bytes_of("accu_grads") == p.bytes_of("master") == p.bytes_of("gathered_weights") == 0
    assert p.bytes_of("loss_scale") == 4 and p.bytes_of("optimizer_step") == 4
    # fp32 activations (e = 4), s 32, b 2, h 64, f 64, 4 heads, KV width 32: sbh = sbf = 4,096, a s^2 b = 8,192.
    # Kept per layer (activation_terms): norm inputs fp32 32,768 + norm outputs 32,768 + q/k/v outputs 32,768
    # + rotary fp32 24,576 + KV broadcast 32,768 + Q/K/V 49,152 + attention output 32,768 + gate/up 32,768
    # + silu output and product 32,768 = 303,104; softmax output 32,768; working S x S scores 65,536.
    assert p.activation_bytes_none == p.bytes_of("activations") == 2 * (303_104 + 32_768) + 65_536
    assert p.activation_bytes_selective == 2 * 303_104 + 65_536 + 32_768   # one layer's core attention rebuilt
    assert p.activation_bytes_full == 2 * 4 * 4_096 + 65_536 + 303_104 + 32_768  # one whole layer rebuilt
    # The lm_head output (vocabulary padded to 112) + the loss's fp32 logits, log_softmax, one-hot, gradient.
    assert p.bytes_of("logits") == 4 * 64 * 112 + 4 * 4 * 64 * 112
    assert p.recompute == "none" and p.in_flight == 1
    assert p.total_bytes == 255_232 * 2 + 510_464 + 8 + p.activation_bytes_none + p.bytes_of("logits")
    assert p.total_bytes == sum(t.bytes for t in p.terms)


def test_16bit_weights_halve_weights_gathered_and_accu_grads_and_add_sliced_masters():
    level1 = ASCEND + ("parallel_config.data_parallel=4", "parallel.enable_parallel_optimizer=True",
                       "runner_config.gradient_accumulation_steps=2", "model.model_config.compute_dtype=bfloat16",
                       "parallel.parallel_optimizer_config.parallel_optimizer_threshold=0")
    fp32 = plan(recipe(*level1), device="Ascend910B2")
    bf16 = plan(recipe(*level1, "model.model_config.param_dtype=bfloat16"), device="Ascend910B2")
    norms = 4 * (2 * 2 * 64 + 64)  # RMSNorm weights stay float32 (2 layers, 2 norms each, the final norm)
    whole = fp32.bytes_of("accu_grads")  # level1: accu_grads whole (no gradient_accumulation_shard)
    assert whole == fp32.bytes_of("gathered_weights") == 4 * fp32.parameters
    assert bf16.bytes_of("accu_grads") == bf16.bytes_of("gathered_weights") == (whole - norms) // 2 + norms
    assert bf16.bytes_of("master") == (whole - norms) // 4        # float32, sliced over DP 4 like the moments
    assert bf16.bytes_of("moments") == fp32.bytes_of("moments") == 2 * whole // 4
    assert bf16.bytes_of("gradients") == fp32.bytes_of("gradients") == 0  # accumulated into accu_grads
    level2 = plan(recipe(*level1, "model.model_config.param_dtype=bfloat16",
                         "parallel.parallel_optimizer_config.optimizer_level=level2"), device="Ascend910B2")
    assert level2.bytes_of("accu_grads") == bf16.bytes_of("accu_grads") // 4   # gradient_accumulation_shard
    level3 = plan(recipe(*level1, "model.model_config.param_dtype=bfloat16",
                         "parallel.parallel_optimizer_config.optimizer_level=level3"), device="Ascend910B2")
    assert level3.bytes_of("accu_grads") == bf16.bytes_of("accu_grads")         # level3 turns the shard off


def test_recompute_modes_order_and_layer_formula():
    p = plan(recipe(*LLAMA2_7B, "parallel_config.model_parallel=8"), device="Ascend910B2")
    assert p.activation_bytes_full < p.activation_bytes_selective < p.activation_bytes_none
    cfg = recipe(*LLAMA2_7B).model.model_config
    sbh = 4096 * 4096
    # bf16, MHA (no KV broadcast), no TP: norms 8 + 4 sbh, q/k/v 6, rotary fp32 8, Q/K/V 6, attention output
    # 2 + 2; SwiGLU 4 + 4 sbf; softmax fp32 4 a s^2 b and its bf16 cast 2 a s^2 b.
    assert layer_activation_bytes(cfg, 1, 1, "none") == 36 * sbh + 8 * 4096 * 11008 + 6 * 32 * 4096 ** 2
    assert layer_activation_bytes(cfg, 1, 1, "full") == 2 * sbh
    # Every operator has a strategy: TP splits all but the norms' tensors (12 sbh, no sequence parallelism).
    sbf = 4096 * 11008
    split = (6 + 8 + 6 + 4) * sbh // 8 + 8 * sbf // 8
    assert layer_activation_bytes(cfg, 1, 8, "selective") == 12 * sbh + split
    flash = recipe(*LLAMA2_7B, "model.model_config.use_flash_attention=True").model.model_config
    # FlashAttention: no S x S term; two fp32 (B, heads, S, 8) softmax statistics instead.
    assert layer_activation_bytes(flash, 1, 1, "none") == 36 * sbh + 8 * sbf + 2 * 4 * 32 * 4096 * 8
    assert recompute_working_bytes(flash, 1, 1, "none") == 0


def test_planner_terms_match_the_real_tensors_on_cpu():
    """Each counted term is the size of the tensor models/llama.py really makes (TP 1, fp32, CPU)."""
    import mindspore as ms
    import numpy as np
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.training.tools.activations import activation_terms, logits_bytes

    r = recipe(*SMALL)
    c = r.model.model_config
    net = LlamaForCausalLM(LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=1,
                                       num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                       intermediate_size=c.intermediate_size, seq_length=c.seq_length))
    b, s, layer = 2, c.seq_length, net.model.layers[0]
    tokens = ms.Tensor(np.random.default_rng(0).integers(4, 100, (b, s)), ms.int32)
    x = net.model.embed_tokens(tokens)
    normed = layer.input_layernorm(x)
    q = layer.self_attn.q_proj(normed).reshape(b, s, c.num_heads, -1).transpose(0, 2, 1, 3)
    qk = layer.self_attn.core.qk_matmul(q, q)
    scores = qk.astype(ms.float32) + net.model.causal_mask
    gate = layer.mlp.gate_proj(normed)
    head = net.lm_head(net.model.norm(x))
    logits = net.logits(tokens)
    terms = activation_terms(c, b, 1)
    assert terms["scores_at_mask_add"][0] == scores.nbytes + qk.nbytes
    assert terms["softmax_fp32"][0] == ms.ops.softmax(scores, -1).nbytes
    assert terms["norm_outputs"][0] == 2 * normed.nbytes
    assert terms["swiglu_split"][0] == 2 * gate.nbytes and terms["swiglu_activation"][0] == 2 * gate.nbytes
    assert logits_bytes(c, b, 1) == head.nbytes + 4 * head.nbytes  # fp32 compute: the projection is fp32
    assert logits.shape == (b, s, 100) and logits.dtype == ms.float32


def test_optimizer_sharding_divides_by_data_parallel():
    dp4 = ASCEND + ("parallel_config.data_parallel=4",
                    "parallel.parallel_optimizer_config.parallel_optimizer_threshold=0")
    unsharded = plan(recipe(*dp4), device="Ascend910B2")
    sharded = plan(recipe(*dp4, "parallel.enable_parallel_optimizer=True"), device="Ascend910B2")
    assert not unsharded.optimizer_sharded and sharded.optimizer_sharded
    assert sharded.bytes_of("moments") * 4 == unsharded.bytes_of("moments")
    # level1: a 1/DP slice plus the all-gathered copy that lives from forward to backward.
    assert sharded.bytes_of("weights") * 4 == unsharded.bytes_of("weights") == sharded.bytes_of("gathered_weights")
    assert sharded.bytes_of("gradients") == unsharded.bytes_of("gradients")
    level3 = plan(recipe(*dp4, "parallel.enable_parallel_optimizer=True",
                         "parallel.parallel_optimizer_config.optimizer_level=level3"), device="Ascend910B2")
    assert level3.bytes_of("gradients") == unsharded.bytes_of("gradients") // 4
    # level3 re-gathers each weight at its use: the most at once is one layer's (tiny_cpu.yaml's 4 attention and 3
    # MLP matrices and 2 norms, float32), more than the 512 x 64 embedding or lm_head
    layer = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64)
    assert level3.bytes_of("gathered_weights") == layer == 184_832 > 4 * 512 * 64
    # The default threshold (64 KB): the norms stay whole on every rank.
    default = plan(recipe(*ASCEND, "parallel_config.data_parallel=4", "parallel.enable_parallel_optimizer=True"),
                   device="Ascend910B2")
    assert default.bytes_of("weights") > sharded.bytes_of("weights")
    # MindSpore shards optimizer states only in semi-auto/auto parallel: not in data-parallel mode.
    data_parallel_mode = plan(recipe(*dp4, "parallel.enable_parallel_optimizer=True", "parallel.parallel_mode=0"),
                              device="Ascend910B2")
    assert not data_parallel_mode.optimizer_sharded
    assert any("only in semi-auto/auto" in n for n in data_parallel_mode.notes)


def test_tensor_parallel_halves_weights():
    split_vocab = ASCEND + ("parallel_config.vocab_emb_dp=False",)
    tp1 = plan(recipe(*split_vocab), device="Ascend910B2")
    tp2 = plan(recipe(*split_vocab, "parallel_config.model_parallel=2"), device="Ascend910B2")
    h, layers = 64, 2
    replicated = 4 * (layers * 2 * h + h)  # RMSNorm weights stay whole on every TP rank
    assert tp2.bytes_of("weights") == (tp1.bytes_of("weights") - replicated) // 2 + replicated
    assert tp2.bytes_of("weights") == pytest.approx(tp1.bytes_of("weights") / 2, rel=0.01)
    assert tp2.bytes_of("gradients") * 2 == pytest.approx(tp1.bytes_of("gradients"), rel=0.01)
    # vocab_emb_dp (the default) keeps the embedding table whole on every TP rank.
    replicated_table = plan(recipe(*ASCEND, "parallel_config.model_parallel=2"), device="Ascend910B2")
    assert replicated_table.bytes_of("weights") - tp2.bytes_of("weights") == 4 * 512 * 64 // 2


def test_pipeline_reports_the_heaviest_stage():
    r = recipe(*ASCEND, "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4")
    p = plan(r, device="Ascend910B2")
    assert p.stage_layers == [1, 1] and len(p.stage_total_bytes) == 2
    assert p.total_bytes == max(p.stage_total_bytes) == p.stage_total_bytes[p.stage]
    # 1F1B: the first stage holds pipeline_stage micro-batches in flight, the last one and the logits.
    first, last = stage_memory(r)
    assert first.in_flight == 2 and first.bytes_of("logits") == 0 and last.in_flight == 1
    assert last.bytes_of("logits") > 0
    # Pipeline stages make MindFormers build MFPipelineWithLossScaleCell: accu_grads on every stage.
    assert first.bytes_of("accu_grads") > 0 and last.bytes_of("accu_grads") > 0
    cfg = r.model.model_config
    assert (stage_parameters(cfg, 0, 1, 2) + stage_parameters(cfg, 1, 1, 2)) == param_count(cfg)


def test_step_time_at_the_stated_mfu():
    r = recipe(*LLAMA2_7B, "parallel_config.model_parallel=8", "recompute_config.recompute=True")
    p = plan(r, device="Ascend910B2", mfu=0.5)
    assert p.flops_per_token == flops_per_token(r.model.model_config)
    assert p.tokens_per_step == r.tokens_per_step == 4096
    assert p.step_time_s == pytest.approx(4096 * p.flops_per_token / (8 * 376e12 * 0.5))
    assert plan(recipe(), device="CPU").step_time_s is None  # no peak FLOP/s for a CPU
    assert plan(r, device="Ascend910A").step_time_s is None   # the 910A has no bf16


def test_tiny_and_demo_recipes_plan_on_this_machine():
    for path in (TINY_RECIPE, DEMO_RECIPE):
        p = plan(load_recipe(path))
        assert p.device == "CPU" and p.fits and p.device_memory_bytes == DEVICES["CPU"].memory_bytes
        text = format_plan(p)
        assert "fits: " in text and "weights (fp32)" in text and "checkpoint per save:" in text
    with open("/proc/meminfo") as f:
        assert DEVICES["CPU"].memory_bytes == int(f.readline().split()[1]) * 1024


def test_llama2_7b_on_one_64gb_device_does_not_fit_but_tp8_with_recompute_does():
    single = plan(recipe(*LLAMA2_7B), device="Ascend910B2")
    assert single.bytes_of("weights") == 4 * 6_738_415_616  # the published count; 32,000 is already 16-aligned
    assert not single.fits and single.device_memory_bytes == 64 * GB
    text = format_plan(single)
    assert "WILL NOT FIT: needs" in text and "device has 64.00 GiB" in text
    levers = text.split("levers in order: ")[1]
    assert levers.startswith("recompute")
    assert levers.index("recompute (full") < levers.index("optimizer-state sharding") < levers.index("pipeline") \
        < levers.index("tensor parallel")
    assert "attention: math path (fp32 S x S scores per layer)" in text

    tp8 = plan(recipe(*LLAMA2_7B, "parallel_config.model_parallel=8", "recompute_config.recompute=True"),
               device="Ascend910B2")
    assert tp8.fits and tp8.recompute == "full" and tp8.bytes_of("activations") == tp8.activation_bytes_full
    text = format_plan(tp8)
    assert "activations (full recompute, 1 micro-batch in flight)" in text
    assert "(activations with no recompute: " in text
    assert "fits: " in text and "WILL NOT FIT" not in text


def test_max_device_memory_caps_the_budget():
    p = plan(recipe(*ASCEND, "context.max_device_memory=58GB"), device="Ascend910B2")
    assert p.device_memory_bytes == 58 * GB and "max_device_memory" in p.device_memory_note


def test_unknown_device_names_the_known_ones():
    with pytest.raises(PretrainError, match="(?s)unknown device 'H100'.*Ascend910B2"):
        plan(recipe(), device="H100")
    assert plan(recipe(*ASCEND), device="ascend910b3").device == "Ascend910B3"
    assert all(spec.source for spec in DEVICES.values())


def test_the_report_says_which_attention_runs_and_which_operators_are_sharded():
    tp2 = recipe(*LLAMA2_7B, "parallel_config.model_parallel=2", "model.model_config.use_flash_attention=True")
    p = plan(tp2, device="Ascend910B2")
    text = format_plan(p)
    assert "attention: FlashAttention (FlashAttentionScore; no S x S scores kept)" in text
    assert "TP 2 splits heads from q/k/v to the attention output, the MLP width and the vocabulary" in text
    math = plan(recipe(*LLAMA2_7B, "parallel_config.model_parallel=2"), device="Ascend910B2")
    assert math.activation_bytes_none - p.activation_bytes_none > 32 * 6 * 32 * 4096 ** 2 // 2 // 2


def _categories_of(name: str) -> str:
    """What a train-step cell's Parameter is, by its name."""
    name = name.split("optimizer.", 1)[-1]
    return ("moments" if name.startswith(("adam_m.", "adam_v.")) else
            "master" if name.startswith("master.") else
            "accu_grads" if name.startswith("accu_grads.") else
            "loss_scale" if name in ("scale_sense", "current_iterator_step", "last_overflow_iterator_step") else
            "optimizer_step" if name in ("global_step", "learning_rate", "master_filled") else "weights")


def _categories(cell) -> dict:
    """nbytes of the real Parameters of a train-step cell, grouped by what their names say they are."""
    groups = {}
    for p in cell.get_parameters():
        category = _categories_of(p.name)
        groups[category] = groups.get(category, 0) + p.nbytes
    return groups


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_planner_terms_equal_the_real_train_step_parameters(dtype):
    """The wrapper MindFormers builds for the recipe (stand-alone: MFTrainOneStepCell, via ours), the real
    FoldedAdamW and the accu_grads clone of wrapper.py:849: each category's bytes are the planner's."""
    import mindspore as ms
    from mindformers.core import build_lr
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.training.worker.optim import FoldedAdamW
    from ascend_llm_recipes.training.tools.planner import RECOMPUTE_MODES, stage_terms
    from ascend_llm_recipes.training.worker.train_step import PortableTrainOneStepCell

    dtypes = (f"model.model_config.param_dtype={dtype}", f"model.model_config.compute_dtype={dtype}",
              "model.model_config.qkv_bias=True")
    r = recipe(*SMALL, *dtypes)
    c = r.model.model_config
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
              "seq_length", "qkv_bias", "vocab_pad_multiple", "compute_dtype", "param_dtype")
    net = LlamaForCausalLM(LlamaConfig(**{f: getattr(c, f) for f in fields}))
    schedule = build_lr({"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 2, "total_steps": 8})
    optimizer = FoldedAdamW(net.trainable_params(), learning_rate=schedule)  # recipes always have an lr_schedule
    step = PortableTrainOneStepCell(net, optimizer, scale_sense=1.0)
    real = _categories(step)
    planned = {}
    for t in stage_terms(r, 0, c.num_layers, "none", 1):
        planned[t.category] = planned.get(t.category, 0) + t.bytes
    for category in ("weights", "master", "moments", "loss_scale", "optimizer_step"):
        assert real.get(category, 0) == planned.get(category, 0), category
    assert ("master" in real) == (dtype != "float32")
    # Semi-auto parallel with accumulation: MindFormers' MFPipelineWithLossScaleCell allocates accu_grads as
    # `self.weights.clone(prefix="accu_grads", init="zeros")` (wrapper.py:849); it refuses stand-alone mode,
    # so the clone is made here by that same call on the same optimizer.
    accu = optimizer.parameters.clone(prefix="accu_grads", init="zeros")
    # float16 on Ascend needs a loss scale (recipe rule); the scale's state is not an accu_grads term.
    scaled = ("runner_wrapper.scale_sense={type: DynamicLossScaleUpdateCell, loss_scale_value: 65536.0, "
              "scale_factor: 2, scale_window: 1000}",) if dtype == "float16" else ()
    pipeline = recipe(*SMALL, *dtypes, *ASCEND, *scaled, "runner_config.gradient_accumulation_steps=2")
    accu_planned = sum(t.bytes for t in stage_terms(pipeline, 0, c.num_layers, "none", 1) if t.category == "accu_grads")
    assert sum(p.nbytes for p in accu) == accu_planned > 0
    assert {p.dtype for p in accu} == ({ms.float32} if dtype == "float32" else {ms.float16, ms.float32})
    assert RECOMPUTE_MODES


def test_moe_planner_terms_equal_the_real_train_step_parameters():
    """The same for tiny_moe_cpu.yaml's model (a dense layer, an MoE one with q/k norms): the experts, router and
    norms the planner reads from models/shapes.py are the real Parameters (its per-step routing counters aside)."""
    import os
    from mindformers.core import build_lr
    from ascend_llm_recipes.models.llama import LlamaConfig, LlamaForCausalLM
    from ascend_llm_recipes.models.shapes import STATISTICS
    from ascend_llm_recipes.training.worker.optim import FoldedAdamW
    from ascend_llm_recipes.training.tools.planner import is_expert, stage_tensors, stage_terms
    from ascend_llm_recipes.training.worker.train_step import PortableTrainOneStepCell

    r = recipe(path=os.path.join(os.path.dirname(TINY_RECIPE), "tiny_moe_cpu.yaml"))
    c = r.model.model_config
    net = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in vars(c).items() if k not in ("type", "compute_dtype")}))
    schedule = build_lr({"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 2, "total_steps": 8})
    step = PortableTrainOneStepCell(net, FoldedAdamW(net.trainable_params(), learning_rate=schedule), scale_sense=1.0)
    real = {}
    for p in step.get_parameters():
        if not p.name.endswith(STATISTICS):
            category = _categories_of(p.name)
            real[category] = real.get(category, 0) + p.nbytes
    planned = {}
    for t in stage_terms(r, 0, c.num_layers, "none", 1):
        planned[t.category] = planned.get(t.category, 0) + t.bytes
    # the routed experts the planner splits over expert parallel (planner.is_expert) are the real ones
    experts = sum(p.nbytes for p in net.get_parameters() if is_expert(p.name))
    assert experts == sum(4 * n for name, n, _ in stage_tensors(c, 0, c.num_layers, 1) if is_expert(name)) == \
        4 * 4 * 3 * 48 * 64
    for category in ("weights", "moments", "loss_scale", "optimizer_step"):
        assert real.get(category, 0) == planned.get(category, 0), category


ASCEND_RECIPES = ["llama2_7b_8dev", "llama2_13b_8dev", "llama2_70b_32dev", "dense_100b_64dev", "tiny_ascend",
                  "llama2_7b_910a_16dev", "qwen3_30b_a3b_16dev", "mixtral_8x7b_64dev", "deepseek_v3_256dev",
                  "tiny_moe_ascend", "tiny_deepseek_ascend"]


@pytest.mark.parametrize("name", ASCEND_RECIPES)
def test_every_ascend_recipe_fits_with_ten_percent_headroom(name):
    import glob
    import os
    from ascend_llm_recipes.training.tools.plan_report import HEADROOM, has_headroom
    from ascend_llm_recipes.training.tools.planner import uses_accu_grads

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ascend = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(root, "recipes", "*.yaml"))
                    if load_recipe(p, planning=True).context.device_target == "Ascend")
    assert ascend == sorted(ASCEND_RECIPES), "every Ascend recipe in recipes/ is planned here"
    r = load_recipe(os.path.join(root, "recipes", f"{name}.yaml"), planning=True)
    p = plan(r)
    assert has_headroom(p), f"{name}: {p.total_bytes / GB:.2f} of {p.device_memory_bytes / GB:.2f} GB, < {HEADROOM:.0%}"
    text = format_plan(p)
    assert "checkpoint per save:" in text and "sources:" in text
    if uses_accu_grads(r):  # micro-batches accumulated: MFPipelineWithLossScaleCell's accu_grads
        assert "[accu_grads] mindformers/wrapper/wrapper.py:849" in text
    if r.model.model_config.moe:  # the expert-parallel figures, the recipe's degree among them
        assert f"expert parallel {r.parallel_config.expert_parallel}: " in text and "<- this recipe" in text


def test_checkpoint_size_leaves_accu_grads_out_and_speed_has_terms():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = load_recipe(os.path.join(root, "recipes", "llama2_7b_8dev.yaml"), planning=True)
    p = plan(r)
    saved = sum(t.bytes for t in p.terms if t.persistent and t.category != "accu_grads")
    assert p.checkpoint_rank_bytes == saved and p.checkpoint_total_bytes == saved * r.world_size
    labels = [label for label, _ in p.speed.terms]
    assert labels[0].startswith("matmuls") and any("all-gather" in x for x in labels)
    assert any("AdamW" in x for x in labels) and any("TP 2" in x for x in labels)
    assert p.speed.step_time_s == pytest.approx(sum(s for _, s in p.speed.terms))
    assert "MindFormers 4,160, MindSpeed-LLM 4,672" in format_plan(p)


MOE_DP4 = ASCEND + ("parallel_config.data_parallel=4",
                    "parallel.parallel_optimizer_config.parallel_optimizer_threshold=0")


def moe_recipe(*overrides):
    import os

    return recipe(*MOE_DP4, *overrides, path=os.path.join(os.path.dirname(TINY_RECIPE), "tiny_moe_cpu.yaml"))


def test_expert_parallel_splits_the_routed_experts_and_optimizer_parallel_slices_what_it_leaves():
    # tiny_moe_cpu.yaml: one MoE layer of 4 experts, each gate/up/down 48 x 64 float32: 147,456 bytes of experts
    experts = 4 * 3 * 48 * 64 * 4
    whole = {ep: plan(moe_recipe(f"parallel_config.expert_parallel={ep}"), device="Ascend910B2") for ep in (1, 2, 4)}
    assert whole[1].bytes_of("weights") - whole[2].bytes_of("weights") == experts // 2  # no optimizer parallel
    assert whole[1].bytes_of("weights") - whole[4].bytes_of("weights") == experts * 3 // 4
    assert whole[1].bytes_of("gradients") - whole[4].bytes_of("gradients") == experts * 3 // 4
    sharded = {ep: plan(moe_recipe(f"parallel_config.expert_parallel={ep}", "parallel.enable_parallel_optimizer=True"),
                        device="Ascend910B2") for ep in (1, 2, 4)}
    # Optimizer parallel slices each expert over the DP x TP / EP devices holding it: the moments and the sliced
    # weights are 1/DP of the experts at any EP, the gathered copy (what forward and backward use) 1/EP; at EP 4
    # no other device holds the same experts, so they are neither sliced nor gathered.
    assert sharded[1].bytes_of("moments") == sharded[2].bytes_of("moments") == sharded[4].bytes_of("moments")
    assert sharded[1].bytes_of("weights") == sharded[2].bytes_of("weights") == sharded[4].bytes_of("weights")
    assert sharded[1].bytes_of("gathered_weights") - sharded[2].bytes_of("gathered_weights") == experts // 2
    assert sharded[1].bytes_of("gathered_weights") - sharded[4].bytes_of("gathered_weights") == experts
    rows = sharded[2].expert_memory
    assert [ep for ep, _, _ in rows] == [1, 2, 4] and rows[1][2] == sharded[2].total_bytes
    assert [total for _, _, total in rows] == [p.total_bytes for p in sharded.values()]
    # the experts' own bytes at EP 4: weights 1/4 (no copy left to slice over) + their gradients + AdamW m and v
    assert rows[2][1] == experts // 4 * (1 + 1 + 2)
    # the levers: expert parallel up to the largest degree allowed, tensor parallel (the MoE layers then split the
    # sequence over TP)
    assert "expert parallel (up to 4" in ", ".join(sharded[1].levers) and "tensor parallel" in sharded[1].levers
    text = format_plan(sharded[2])
    assert "the routed experts split over EP 2" in text and "expert parallel 2: " in text
    assert "  EP 2    experts" in text and "tokens / TP x top_k x hidden" in text


def test_alltoall_bytes_per_step_and_moe_activations_by_hand():
    from ascend_llm_recipes.training.tools.activations import activation_terms

    p = plan(moe_recipe("parallel_config.expert_parallel=2"), device="Ascend910B2")
    # 1 micro-batch of 4 x 64 tokens, top 2, hidden 64, float32, 1 MoE layer; dispatch + combine, forward and
    # backward; half the copies leave the device at EP 2.
    assert p.alltoall_bytes == 1 * 1 * 4 * (4 * 64 * 2 * 64 * 4) // 2 == 262_144 and p.moe_layers == 1
    full = plan(moe_recipe("parallel_config.expert_parallel=2", "recompute_config.recompute=True"),
                device="Ascend910B2")
    assert full.alltoall_bytes == p.alltoall_bytes * 6 // 4  # the recomputed forward dispatches again
    assert plan(moe_recipe(), device="Ascend910B2").alltoall_bytes == 0
    cfg = moe_recipe().model.model_config
    dense, moe = activation_terms(cfg, 4), activation_terms(cfg, 4, moe=True)
    sb = 4 * 64
    # the MLP of an MoE layer: 2 x 48-wide experts per token instead of the 176-wide dense MLP
    assert moe["swiglu_split"][0] == 2 * 4 * sb * 2 * 48 and dense["swiglu_split"][0] == 2 * 4 * sb * 176
    assert moe["router_fp32"][0] == 2 * 4 * sb * 4 and moe["dispatched_tokens"][0] == 2 * 4 * sb * 2 * 64
    # the dense first layer and the MoE second one each counted as what they are
    moe = activation_terms(cfg, 4, moe=True, expert_parallel=2)  # the plan's: the dispatched copies at EP 2
    assert p.activation_bytes_none == sum(n for n, kind in dense.values() if kind != "working") + \
        sum(n for n, kind in moe.values() if kind != "working") + max(
            sum(n for n, kind in terms.values() if kind == "working") for terms in (dense, moe))


def test_an_ascend_moe_layout_the_launch_refuses_is_said_so_and_not_proposed(tmp_path):
    """What MindFormers' MoE layer would compute otherwise than the recipe asks (here a capacity factor) is said by
    --plan as refused at launch; a pipeline, whose micro-batches it balances over as the recipe asks
    (router_aux_loss_scope global: gbs_aux_loss), is planned and proposed as a memory lever."""
    import os

    from conftest import REPO_ROOT

    path = os.path.join(REPO_ROOT, "recipes", "qwen3_30b_a3b_16dev.yaml")
    piped = plan(load_recipe(path, [f"output_dir={tmp_path}", "parallel_config.pipeline_stage=2",
                                    "parallel_config.data_parallel=8", "parallel_config.expert_parallel=8",
                                    "parallel_config.micro_batch_num=4"], planning=True))
    assert piped.fits and piped.refusals == []
    dropping = plan(load_recipe(path, [f"output_dir={tmp_path}", "model.model_config.capacity_factor=1.25"],
                                planning=True))
    assert len(dropping.refusals) == 1 and "refused at launch" in dropping.refusals[0]
    assert "capacity_factor" in dropping.refusals[0] and "but refused at launch" in format_plan(dropping)
    short = plan(load_recipe(path, [f"output_dir={tmp_path}", "parallel_config.expert_parallel=1"], planning=True))
    assert not short.fits and not short.refusals and "expert parallel (up to 4" in ", ".join(short.levers)
    assert plan(load_recipe(path, planning=True)).refusals == []


def test_levers_name_the_optimizer_level_flash_attention_and_16_bit_weights_left_unused(tmp_path):
    """A layout that does not fit names each memory lever the recipe leaves unused, with what it would save."""
    import os

    from conftest import REPO_ROOT

    path = os.path.join(REPO_ROOT, "recipes", "deepseek_v3_256dev.yaml")
    mc = "model.model_config."
    short = plan(load_recipe(path, [f"output_dir={tmp_path}", mc + "use_flash_attention=False",
                                    mc + "use_attn_mask_compression=False", mc + "param_dtype=float32",
                                    "parallel.parallel_optimizer_config.optimizer_level=level1"], planning=True))
    assert not short.fits
    levers = ", ".join(short.levers)
    for lever in ("optimizer level3 (parallel.parallel_optimizer_config.optimizer_level: -",
                  "FlashAttention (model.model_config.use_flash_attention: -",
                  "16-bit weights (model.model_config.param_dtype: bfloat16: -"):
        assert lever in levers
    assert "every lever is in use" not in format_plan(short)


def test_collectives_are_charged_at_the_links_their_group_crosses():
    """F7: a group within one node at the intra-node (HCCS) bandwidth, one spanning nodes at the inter-node (RoCE)."""
    from ascend_llm_recipes.training.tools.planner import link_bytes_per_s, step_alltoall_bytes

    spec = DEVICES["Atlas800T-A2-910B2"]
    assert (spec.intra_node_bytes_per_s, spec.inter_node_bytes_per_s) == (100e9, 25e9)
    deepseek = load_recipe(os.path.join(REPO_ROOT, "recipes", "deepseek_v3_256dev.yaml"), planning=True)
    assert link_bytes_per_s(deepseek, spec, 8) == 100e9      # 8 consecutive ranks: one node of 8
    assert link_bytes_per_s(deepseek, spec, 2, 8) == 25e9    # 2 ranks 8 apart (a DP group of TP 8): two nodes
    assert link_bytes_per_s(deepseek, spec, 16) == 25e9      # DeepSeek's EP group is 256 consecutive ranks
    speed = plan(deepseek).speed
    alltoall = dict(speed.terms)["expert parallel 256: AllToAll dispatch and combine, forward and backward"]
    assert alltoall == step_alltoall_bytes(deepseek, 0, 61) / 25e9
    assert "25 GB/s across nodes (DP, EP groups span nodes)" in speed.notes[0]
    # the same tiny MoE layout on a node of 8 and on nodes of 4: its EP 8 group leaves the node on the second
    tiny = os.path.join(REPO_ROOT, "recipes", "tiny_moe_ascend.yaml")
    bf16 = ["parallel_config.expert_parallel=8", "model.model_config.compute_dtype=bfloat16"]  # a 16-bit peak
    terms = [dict(plan(load_recipe(tiny, [*bf16, f"hardware.devices_per_node={n}"], planning=True)).speed.terms)
             for n in (8, 4)]
    label = "expert parallel 8: AllToAll dispatch and combine, forward and backward"
    assert terms[1][label] == 4 * terms[0][label]


def test_level3_gather_is_the_largest_gathered_at_once_and_dispatch_has_an_imbalance_allowance():
    """F8: level 3 holds the largest weight (or layer) it gathers, not an average layer; expert parallel's dispatched
    tokens are planned above the even share, which only a perfectly balanced router reaches."""
    import math
    from ascend_llm_recipes.training.tools.activations import MOE_LOAD_ALLOWANCE, activation_terms

    deepseek = load_recipe(os.path.join(REPO_ROOT, "recipes", "deepseek_v3_256dev.yaml"), planning=True)
    gathered = next(t for t in plan(deepseek).terms if t.category == "gathered_weights")
    assert gathered.bytes == 129280 * 7168 * 2 and "model.embed_tokens.weight" in gathered.label  # 1.85e9 bytes
    cfg = deepseek.model.model_config
    even = activation_terms(cfg, 1, moe=True)["dispatched_tokens"][0]
    assert even == 2 * 2 * cfg.seq_length * cfg.num_experts_per_tok * cfg.hidden_size  # bf16, in and out
    assert MOE_LOAD_ALLOWANCE == 1.1
    spread = activation_terms(cfg, 1, moe=True, expert_parallel=256)["dispatched_tokens"][0]
    assert spread == math.ceil(even * 1.1)


def test_16bit_weights_with_accumulation_are_said_to_sum_gradients_in_16_bits():
    """F5: accu_grads is a clone of the weights (wrapper.py:849): with bf16 weights the micro-batches sum in bf16.
    Qwen3-30B-A3B keeps float32 weights as MindFormers' own config does; the Llama 2 7B recipe is told."""
    qwen3 = load_recipe(os.path.join(REPO_ROOT, "recipes", "qwen3_30b_a3b_16dev.yaml"), planning=True)
    assert qwen3.model.model_config.param_dtype == "float32" and qwen3.parallel_config.micro_batch_num == 16
    assert not [n for n in plan(qwen3).notes if "summed in" in n]
    llama = plan(load_recipe(os.path.join(REPO_ROOT, "recipes", "llama2_7b_8dev.yaml"), planning=True))
    assert any("param_dtype bfloat16 with accumulation: accu_grads clones the weights in their dtype" in n and
               "summed in bfloat16" in n for n in llama.notes)


def test_byte_sizes_read_in_binary_units_labelled_as_such():
    from ascend_llm_recipes.common.units import byte_size

    assert [byte_size(n) for n in (341.23 * GB, 64 * GB, 1_887_436.8, 12 * 1024, 4, -2.5 * GB)] == \
        ["341.23 GiB", "64.00 GiB", "1.8 MiB", "12.0 KiB", "4 B", "-2.50 GiB"]


def test_plan_and_check_print_sizes_in_one_unit_small_ones_in_mib(tmp_path):
    """D14 (issue 39): --plan printed GiB labelled GB and --check decimal GB for the same checkpoint; the tiny plan's
    checkpoint read 0.00 GB. Every size is GiB (MiB, KiB, B when smaller), one function printing them all."""
    import re
    from ascend_llm_recipes.common.units import byte_size
    from ascend_llm_recipes.training.launcher.preflight import check_disk

    qwen3 = load_recipe(os.path.join(REPO_ROOT, "recipes", "qwen3_30b_a3b_16dev.yaml"), planning=True)
    big = plan(qwen3)
    text = format_plan(big)
    assert f"{byte_size(big.checkpoint_total_bytes)} in all" in text and "GiB in all" in text
    assert f"fits: {byte_size(big.total_bytes)} of 58.00 GiB" in text
    tiny = format_plan(plan(recipe()))
    assert re.search(r"checkpoint per save: \d+\.\d MiB per rank", tiny), tiny
    for shown in (text, tiny):  # the recipe's own max_device_memory and the device's cited source aside
        ours = [line for line in shown.replace("max_device_memory 58GB", "").splitlines()
                if not line.startswith("device: ")]
        assert [line for line in ours if re.search(r"\d ?[GMT]B\b(?!/s)", line)] == []
    disk = check_disk(qwen3, str(tmp_path))[0].message
    assert f"{byte_size(big.checkpoint_total_bytes)} per checkpoint" in disk
    assert re.findall(r"\d ?[GMT]B\b", disk) == []
