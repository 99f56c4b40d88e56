"""Parallel layout of the Llama model, in one place: tensor-parallel shard strategies,
layer-to-pipeline-stage assignment, and full or selective recompute.

`plan_layout` is pure arithmetic (testable anywhere) and gives a typed `LlamaLayout`, which
training plans from the recipe (training/recipe/mindformers.py model_layout) and hands to
`LlamaForCausalLM(config, layout)`; `apply_layout` sets the strategies on the model's Primitives,
`pipeline_stage` on its Cells and recompute flags. Strategies and stages only take effect
under MindSpore's semi-auto parallel mode, which needs Ascend (or GPU); in other modes MindSpore
ignores them (mindspore/ops/primitive.py:262-263), so they are set for every layout, data parallel
only included, and checked on CPU.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019): q/k/v and gate/up are split
by output columns (attention heads, MLP width), o and down by input rows, so each
layer needs one reduction after attention and one after the MLP; the vocabulary is split
across the output projection (and, unless vocab_emb_dp, the embedding table).
"""

from dataclasses import dataclass, field

from ascend_llm_recipes.models.shapes import dimensions

RECOMPUTE_MODES = ("none", "selective", "full")  # by memory saved: core attention only, then whole layers


def recompute_mode(recompute: bool, select_recompute: bool) -> str:
    """The mode recompute_config's two flags select: full (whole layers, core attention included) wins
    over selective; the recipe refuses both set at once."""
    return "full" if recompute else "selective" if select_recompute else "none"


# recompute_config keys MindSpore's Cell.recompute acts on (mindspore/nn/cell.py:3685-3692); its third,
# parallel_optimizer_comm_recompute, only logs a warning in 2.9 and is refused by the recipe check.
RECOMPUTE_OPTIONS = ("mp_comm_recompute", "recompute_slice_activation")


@dataclass
class LlamaLayout:
    data_parallel: int
    tensor_parallel: int
    pipeline_stages: int
    micro_batches: int
    stage_of_layer: list
    recompute: str = "none"        # none | full (whole decoder layer) | selective (core attention)
    strategies: dict = field(default_factory=dict)  # role -> in_strategy
    # Cell.recompute's keyword options (RECOMPUTE_OPTIONS), as recompute_config sets them.
    recompute_options: dict = field(default_factory=dict)
    gradient_aggregation_group: int = 4   # gradient all-reduce fusion groups without pipelining
    # MindFormers' TransformerConfig of the MoE layers when they run as its MoELayer with expert parallel (Ascend;
    # models/expert_parallel.py), else None: models/moe.py's MoE, the CPU reference. Not in the layout's repr:
    # MindFormers pprints the config holding the layout (trainer/base_trainer.py:1671-1672), and pprint fails on
    # the MindSpore dtypes inside a TransformerConfig.
    experts: object = field(default=None, repr=False)

    @property
    def layers_per_stage(self) -> list:
        return [self.stage_of_layer.count(s) for s in range(self.pipeline_stages)]


def balanced_stages(num_layers: int, stages: int) -> list:
    """Per-stage layer counts as even as possible; extra layers go to the middle stages,
    since the first holds the embedding and the last the output projection and loss."""
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(extra):
        counts[middle[i % len(middle)]] += 1
    return counts


def layout_problems(cfg, dp: int, tp: int, pp: int, micro_batches: int = 1, stage_layers=None,
                    recompute: str = "none", ep: int = 1, cpu: bool = False) -> list:
    """Every reason the degrees do not fit the model, each naming the recipe keys involved (`cpu`: the recipe runs
    on CPU, where expert parallel has no backend)."""
    problems = []
    kv_heads = cfg.kv_heads
    vocab = dimensions(cfg, tp)["padded_vocab"]
    for what, value in (("model.model_config.num_heads", cfg.num_heads),
                        ("model.model_config.num_kv_heads", kv_heads),
                        ("model.model_config.intermediate_size", cfg.intermediate_size),
                        ("padded vocabulary", vocab)):
        if value % tp:
            problems.append(f"parallel_config.model_parallel: {tp} does not divide {what} ({value})")
    if pp > cfg.num_layers:
        problems.append(f"parallel_config.pipeline_stage: {pp} stages exceed model.model_config.num_layers "
                        f"({cfg.num_layers})")
    if pp > 1 and micro_batches < pp:
        problems.append(f"parallel_config.micro_batch_num: {micro_batches} is below pipeline_stage {pp}; "
                        "the pipeline would idle (use at least as many micro-batches as stages, ideally 4x)")
    if stage_layers is not None:
        if len(stage_layers) != pp or sum(stage_layers) != cfg.num_layers or min(stage_layers) < 1:
            problems.append(f"parallel_config.stage_layers: {list(stage_layers)} must have pipeline_stage ({pp}) "
                            f"entries, each >= 1, summing to num_layers ({cfg.num_layers})")
    if recompute not in RECOMPUTE_MODES:
        problems.append(f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if pp > 1 and getattr(cfg, "tie_word_embeddings", False):
        # The tied output projection reads the embedding table, which lives on stage 0, while the
        # logits belong to the last stage: no stage owns it. MindFormers 1.9's Llama shares the
        # Parameter the same way (mindformers/models/llama/llama.py:521-522) with no stage rule.
        problems.append(f"model.model_config.tie_word_embeddings: True with parallel_config.pipeline_stage {pp} "
                        "leaves the output projection without a pipeline stage (the table is on stage 0, the "
                        "logits on the last); untie the embeddings or use pipeline_stage 1")
    return problems + expert_problems(cfg, dp, tp, ep, cpu)


def expert_problems(cfg, dp: int, tp: int, ep: int, cpu: bool = False) -> list:
    """Every reason parallel_config.expert_parallel does not fit the model or the layout, each naming its keys.

    Expert parallel is MindFormers 1.9's: the routed experts are split over `ep` devices carved out of the
    data x model parallel ones (no devices of its own), tokens reach them by AllToAll.
    """
    p, m = "parallel_config", "model.model_config"
    problems = []
    if ep > 1 and not cfg.moe:
        problems.append(f"{p}.expert_parallel: {ep} on a dense model ({m}.num_experts 0): there are no experts to "
                        "split; set it to 1")
    if ep > 1 and cpu:
        # No CPU backend: the CPU path (models/moe.py) computes every expert on the local device, no AllToAll.
        problems.append(f"{p}.expert_parallel: {ep} needs Ascend; expert parallel has no CPU backend (the CPU path "
                        "computes every expert locally). Use 1 on CPU")
    if not cfg.moe:
        return problems
    # mindformers/parallel_core/training_graph/transformer/moe/moe_layer.py:60-63 (BaseMoELayer.__init__)
    if cfg.num_experts % ep:
        problems.append(f"{p}.expert_parallel: {ep} does not divide {m}.num_experts ({cfg.num_experts})")
    # mindformers/parallel_core/training_graph/transformer/moe/ffn.py:189-195 (FFNGroupedGEMM.shard)
    if (dp * tp) % ep:
        problems.append(f"{p}.expert_parallel: {ep} does not divide {p}.data_parallel x model_parallel "
                        f"({dp} x {tp} = {dp * tp}): the experts are split over devices of those groups")
    # With tensor parallel MindFormers' MoE layer runs sequence parallel (moe_layer.py:143-147 raises otherwise):
    # its tokens split over TP along the sequence, which its reshapes take as seq_length // TP (moe_layer.py:226-227)
    if tp > 1 and cfg.seq_length % tp:
        problems.append(f"{p}.model_parallel: {tp} does not divide {m}.seq_length ({cfg.seq_length}): with tensor "
                        "parallel the MoE layers split each sequence over the tensor-parallel ranks")
    return problems


def plan_layout(cfg, dp: int = 1, tp: int = 1, pp: int = 1, micro_batches: int = 1, stage_layers=None,
                recompute: str = "none", vocab_emb_dp: bool = True, recompute_options: dict = None,
                gradient_aggregation_group: int = 4) -> LlamaLayout:
    """The layout for `cfg` at the given degrees; ValueError listing every problem otherwise."""
    problems = layout_problems(cfg, dp, tp, pp, micro_batches, stage_layers, recompute)
    if problems:
        raise ValueError("; ".join(problems))
    counts = list(stage_layers) if stage_layers is not None else balanced_stages(cfg.num_layers, pp)
    stage_of_layer = [stage for stage, n in enumerate(counts) for _ in range(n)]
    column = ((dp, 1), (tp, 1))     # x (N, in) . W (out, in)^T, W split by output rows
    row = ((dp, tp), (1, tp))       # W split by input columns; partial sums reduced
    heads = ((dp, tp, 1, 1), (dp, tp, 1, 1))
    strategies = {
        "column": column, "row": row, "vocab_projection": column,
        "embedding": ((1, 1), (dp, 1)) if vocab_emb_dp else ((tp, 1), (dp, 1)),
        "attention_scores": heads, "attention_softmax": ((dp, tp, 1, 1),), "attention_values": heads,
    }
    return LlamaLayout(dp, tp, pp, micro_batches, stage_of_layer, recompute, strategies,
                       dict(recompute_options or {}), gradient_aggregation_group)


# Operators left without a strategy on purpose: MindSpore derives their layout from their input
# (Cast, Reshape: mindspore/ccsrc/frontend/parallel/step_parallel.cc treats them as layout-preserving) or
# they are graph plumbing, not computation. MindFormers' Llama leaves the same ones unsharded.
UNSHARDED_OPERATORS = ("Cast", "Reshape", "Depend", "MakeTuple", "TupleGetItem", "Return", "Load",
                       "UpdateState", "Shape", "ScalarMul", "ScalarAdd", "ScalarSub", "ScalarDiv",
                       "ScalarFloorDiv", "ZerosLike", "StopGradient", "tuple_getitem", "make_tuple")


def operator_strategies(net, layout: LlamaLayout) -> list:
    """(Primitive, in_strategy) for every operator of the forward pass, as MindFormers' Llama shards them.

    Without sequence parallelism the hidden states (B, S, H) are split by DP only (norms, residual
    adds: llama_transformer.py:985-1001); heads are split by TP from q/k/v to the attention output
    (llama_transformer.py:377-396, layers.py RotaryEmbedding.shard), the MLP width by TP
    (llama_layer.py:503-508) and the vocabulary by TP through the loss (core/loss/loss.py:70-76, 122-126).
    """
    dp, tp = layout.data_parallel, layout.tensor_parallel
    s = layout.strategies
    heads = (dp, tp, 1, 1)
    hidden3, hidden2 = (dp, 1, 1), (dp, 1)
    cfg = net.config
    documents = cfg.document_attention
    out = []

    def add(prim, *strategy):
        out.append((prim, tuple(strategy)))

    def norm(cell, x=hidden3):
        if cell.fused:
            add(cell.norm, x, (1,))        # llama_layer.py:232
        add(cell.square, x)
        add(cell.mean, x)
        add(cell.add, x, ())
        add(cell.rsqrt, x)
        add(cell.mul, x, x)
        add(cell.mul_weight, x, (1,))

    def linear(cell, strategy, bias_strategy):
        add(cell.matmul, *strategy)
        add(cell.bias_add, *bias_strategy)

    model = net.model
    add(model.embed_tokens.gather, *s["embedding"])
    freqs = (dp, 1, 1, 1) if documents else (1, 1, 1, 1)

    def rotary(cell, x):
        add(cell.slice, x)
        add(cell.neg, x)
        add(cell.concat, x, x)
        add(cell.mul, x, freqs)
        add(cell.add, x, x)

    def attention_core(attn):
        core = attn.core
        if attn.flash:
            add(core.flash_attention, *flash_attention_strategy(cfg, dp, tp))
            add(core.merge_heads, heads)
            add(core.to_tokens_q, heads)
            add(core.to_tokens_kv, heads)
        else:
            mask = (dp, 1, 1, 1) if documents else (1, 1, 1, 1)
            add(core.mul_scale, heads, ())
            add(core.qk_matmul, *s["attention_scores"])
            add(core.mask_add, heads, mask)
            add(core.softmax, *s["attention_softmax"])
            add(core.pv_matmul, *s["attention_values"])
            add(core.merge_heads, heads)

    def latent_attention(attn):
        """models/mla.py as MindFormers 1.9 splits its MLASelfAttention (transformer/multi_latent_attention.py
        shard_self_attn :713-727, gpt_layer_specs.py:147-157): the down projections to the latents and their
        norms with replicated weights, the up projections by heads (column), the output projection by rows, every
        per-head tensor by heads; the rotary key, one for all heads, whole on every TP rank (tile_kv :717). Theirs
        splits the down projections' tokens over TP too (SequenceParallelLinear, layers.py:845-866): sequence
        parallel, which ours does not implement, so each TP rank computes the latents whole."""
        down, one_key = ((dp, 1), (1, 1)), (dp, 1, 1, 1)
        if attn.q_proj is not None:
            linear(attn.q_proj, s["column"], ((dp, tp), (tp,)))
        else:
            linear(attn.q_a_proj, down, ((dp, 1), (1,)))
            norm(attn.q_a_layernorm)
            linear(attn.q_b_proj, s["column"], ((dp, tp), (tp,)))
        linear(attn.kv_a_proj_with_mqa, down, ((dp, 1), (1,)))
        norm(attn.kv_a_layernorm)
        linear(attn.kv_b_proj, s["column"], ((dp, tp), (tp,)))
        linear(attn.o_proj, s["row"], ((dp, 1), (1,)))
        add(attn.split_heads, (dp, 1, tp, 1))
        add(attn.split_kv, (dp, 1, tp, 1))
        for part in (attn.q_nope, attn.q_rope, attn.k_nope, attn.value):
            add(part.slice, heads)
        for part in (attn.latent, attn.k_rope):
            add(part.slice, hidden3)
        rotary(attn.rotary_q, heads)
        rotary(attn.rotary_k, one_key)
        add(attn.tile, one_key)
        add(attn.concat_q, heads, heads)
        add(attn.concat_k, heads, heads)

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norm(layer.input_layernorm)
        norm(layer.post_attention_layernorm)
        add(layer.add, hidden3, hidden3)
        if cfg.mla:
            latent_attention(attn)
        else:
            for cell in (attn.q_proj, attn.k_proj, attn.v_proj):
                linear(cell, s["column"], ((dp, tp), (tp,)))
            linear(attn.o_proj, s["row"], ((dp, 1), (1,)))
            if attn.q_norm is not None:  # (B, S, heads, head_dim) normalised per head: split by heads like q and k
                norm(attn.q_norm, (dp, 1, tp, 1))
                norm(attn.k_norm, (dp, 1, tp, 1))
            add(attn.split_heads, (dp, 1, tp, 1))  # (B, S, heads, D) split by heads
            rotary(attn.rotary, heads)
            add(attn.tile_kv, heads)
        attention_core(attn)
        if layer.is_moe:
            continue  # models/moe.py's MoE runs on CPU only; MindFormers' MoELayer shards itself (expert_parallel.py)
        for cell in (mlp.gate_proj, mlp.up_proj):
            linear(cell, s["column"], ((dp, tp), (tp,)))
        linear(mlp.down_proj, s["row"], ((dp, 1), (1,)))
        add(mlp.silu, (dp, 1, tp))
        add(mlp.mul, (dp, 1, tp), (dp, 1, tp))
    norm(model.norm)
    if model.documents is not None:
        d = model.documents
        for prim in (d.equal,):
            add(prim, hidden2, ())
        add(d.cumsum, hidden2)
        add(d.sub, hidden2, hidden2)
        add(d.slice, hidden2)
        add(d.shift, hidden2)
        add(d.mul, hidden2, (1, 1))
        add(d.cummax, hidden2)
        add(d.gather, (1, 1), hidden2)
        add(d.same_doc, hidden3, hidden3)
        add(d.other_doc, (), hidden3)
        add(d.mask_mul, hidden3, ())
        add(d.mask_add, (1, 1, 1, 1), (dp, 1, 1, 1))
    if model.flash_mask is not None:
        f = model.flash_mask
        add(f.not_equal, (dp, 1, 1, 1) if documents else (1, 1, 1, 1), ())
        add(f.tile, (1, 1, 1, 1))
        add(f.equal, hidden2, ())
        add(f.maximum, hidden2, (1, 1))
        add(f.not_end, (), hidden2)
        add(f.mul, hidden2, hidden2)
        add(f.pad_mul, hidden2, ())
        add(f.add, hidden2, hidden2)
        add(f.sort, (1,))
    head = net.head_matmul if net.tie_word_embeddings else net.lm_head.matmul
    add(head, *s["vocab_projection"])
    if not net.tie_word_embeddings:
        add(net.lm_head.bias_add, (dp, tp), (tp,))
    add(net.no_negative_ids, hidden2, ())
    add(net.inputs, hidden2)
    add(net.labels, hidden2)
    # Vocabulary-parallel cross-entropy, MindFormers' strategies (core/loss/loss.py:70-76, 122-126, 246-251).
    loss, vocab, rows = net.loss, (dp, tp), (dp, 1)
    add(loss.pad, vocab, (1, tp))
    add(loss.max, vocab)
    add(loss.sub_max, vocab, rows)
    add(loss.exp, vocab)
    add(loss.sum_exp, vocab)
    add(loss.log, rows)
    add(loss.sub_log, vocab, rows)
    add(loss.onehot, vocab, (), ())
    add(loss.pick, vocab, vocab)
    add(loss.neg, vocab)
    add(loss.sum_vocab, vocab)
    add(loss.not_pad, (dp,), ())
    add(loss.mask_mul, (1,), (1,))
    add(loss.sum_tokens, (1,))
    add(loss.count, (1,))
    add(loss.at_least_one, (), ())
    add(loss.div, (), ())
    return out


def flash_attention_strategy(cfg, dp: int, tp: int) -> tuple:
    """FlashAttentionScore's strategy, MindFormers' _generate_flash_attention_strategy
    (mindformers/modules/flash_attention.py:191-247) without context parallel or dropout."""
    if cfg.use_eod_attn_mask_compression:   # TND, sparse_mode 8, actual sequence lengths
        return ((dp, tp, 1), (dp, tp, 1), (dp, tp, 1), (1, 1), (dp,), (dp,))
    heads = ((dp, tp, 1, 1),) * 3
    if cfg.use_attn_mask_compression:       # sparse_mode 2: the 2048 x 2048 band
        return heads + ((1, 1),)
    return heads + ((dp, 1, 1, 1),)         # sparse_mode 0: the (B, 1, S, S) mask


def apply_layout(net, layout: LlamaLayout) -> None:
    """Set strategies, stages and recompute flags on a LlamaForCausalLM.

    Every operator gets its strategy at every layout, TP 1 included, as MindFormers' Llama shards
    its operators whenever the parallel mode is semi-auto, whatever the degrees
    (mindformers/models/llama/llama.py:294-301, 548-559; llama_transformer.py:373-389, 967-991).
    Left to MindSpore's default batch-parallel strategy, constants with a leading dimension of 1
    (the (1, 1, S, S) mask, the rotary tables) would get replicated layouts and redistribution;
    here they are (1, 1, 1, 1), read whole on every rank, as MindFormers' rotary tables are
    (mindformers/modules/layers.py:1565).
    """
    model = net.model
    last = layout.pipeline_stages - 1
    for prim, strategy in operator_strategies(net, layout):
        prim.shard(strategy)
    model.embed_tokens.pipeline_stage = 0
    model.norm.pipeline_stage = last
    if not net.tie_word_embeddings:
        net.lm_head.pipeline_stage = last
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        layer.pipeline_stage = layout.stage_of_layer[index]
        # Gradient all-reduce fusion groups, as MindFormers' LayerSetting.set_communication_fusion
        # (mindformers/parallel_core/training_graph/transformer/utils.py:419-425).
        if layout.pipeline_stages > 1:
            layer.set_comm_fusion(2)
        else:
            spacing = max((len(model.layers) + 1) // layout.gradient_aggregation_group, 1)
            layer.set_comm_fusion(index // spacing + 1)
        # MindFormers passes recompute_slice_activation to Cell.recompute per layer (utils.py:393);
        # mp_comm_recompute is Cell.recompute's too (mindspore/nn/cell.py:3685-3686).
        if layout.recompute == "full":
            layer.recompute(**layout.recompute_options)
        elif layout.recompute == "selective":
            attn.core.recompute(**layout.recompute_options)


def moe_block(layout: LlamaLayout):
    """What builds a MoE layer under `layout`: MindFormers' MoELayer when layout.experts is set, else None (ours)."""
    if layout.experts is None:
        return None
    from ascend_llm_recipes.models.expert_parallel import MindFormersMoE
    return lambda config: MindFormersMoE(layout.experts)


def optimizer_shard_shape(shape: tuple, itemsize: int, copies: int, threshold_kb: int) -> tuple:
    """The shape one rank holds of a parameter that `copies` data-parallel ranks share, under optimizer parallel.

    MindSpore 2.9 (semi-auto parallel with enable_parallel_optimizer, every optimizer_level) stores each
    rank's part of such a parameter and all-gathers it where it is used. Its compile decides per parameter
    (sources of the 2.9 tree, not in the wheel): step_parallel.cc SetParallelShape takes the optimizer
    slice shape whenever OptParamMgr::ShardOptGroup gives a group; parallel_optimizer/opt_param_mgr.cc
    SplitParam refuses a parameter whose whole size in its own dtype is below parallel_optimizer_threshold
    KB (default 64); tensor_layout.cc GenerateOptShardSliceShape then splits the first dimension over the
    copies (optimizer_weight_shard_size -1, the default: all of them) and refuses one it does not divide.
    AdamW's moments are clones of their parameter and take its shape (parameter_manager.cc
    SetClonedTensorShapeForOptimizer). The slice of rank r is the r-th block of rows within its group, as
    MindSpore's checkpoint transform cuts it (mindspore/parallel/_tensor.py:243-276 _load_tensor_by_layout).
    """
    shape = tuple(shape)
    size = itemsize
    for d in shape:
        size *= d
    if copies <= 1 or not shape or size < threshold_kb * 1024 or shape[0] % copies:
        return shape
    return (shape[0] // copies, *shape[1:])
