"""Mixture-of-Experts layers with expert parallel on Ascend: MindFormers 1.9's own MoELayer in our decoder.

On CPU a MoE layer is models/moe.py's MoE, the reference math. On Ascend, with `layout.experts` set
(models/parallel.py; training/recipe/mindformers.py builds it from the recipe), each MoE layer is instead
MindFormers 1.9's training-graph MoELayer, built from the TransformerConfig MindFormers' own config class makes of
the model section `--to-mindformers` writes (training/recipe/mindformers_mcore_export.py moe_transformer_config).
It brings, as MindFormers' Qwen3-MoE and DeepSeek-V3 run them (files under site-packages mindformers/parallel_core/
training_graph/transformer/moe/): the TopKRouter (router.py), the AllToAll token dispatch over the expert-parallel
group (token_dispatcher.py MoEAlltoAllTokenDispatcher), the experts as two GroupedMatmul calls over stacked
weights (ffn.py:149-163), their shard strategies (moe_layer.py:241-252, ffn.py:186-227) and the shared experts
(shared_experts.py). Re-typing those cells here would be a second, unexecuted copy of them; building them is the
one way the Ascend graph is MindFormers' own.

Their layer is sequence-first, (S, B, hidden) (moe_layer.py:212-239: a transpose in, the tokens reshaped per
data-parallel block, a transpose out); ours is batch-first, so the block transposes around it, sharded on the
batch axis as the rest of our layer is. Its parameters, under the decoder layer's `mlp`:
    router.weight (E, hidden)                  our mlp.gate.weight
    router.expert_bias (E,)                    our mlp.router.expert_bias (only with the correction bias)
    experts.weight1 (E*hidden, 2*F)            per expert e, rows e*hidden..: [gate_proj.T | up_proj.T]
    experts.weight2 (E*F, hidden)              per expert e, rows e*F..: down_proj.T
    shared_experts.linear_fc1.weight (2F', hidden)  our shared_expert gate_proj and up_proj, rows interleaved
    shared_experts.linear_fc2.weight, shared_experts.shared_experts_gate.weight   down_proj, shared_expert_gate
and counters (router.fi_accu, router.expert_load), not weights. stack_experts / unstack_experts below turn our
per-expert tensors into the stacked ones and back, as MindFormers' own converter does Hugging Face's.

Executed here (tests/test_expert_parallel.py): these cells built on CPU inside our model (names, shapes), its
training graph compiled up to the router's TopkExt (Ascend-only), and the model built under semi-auto parallel by
two msrun CPU processes at DP 2 x EP 2 (expert-parallel groups, shard layouts). Not executed here: the forward,
whose TopkExt, GroupedMatmul and AllToAll have no CPU kernels; the acceptance kit (scripts/ascend_acceptance.sh)
runs it on Ascend against the CPU reference.
"""

import numpy as np
from mindspore import ops

from mindformers.parallel_core.training_graph.base_models.gpt.moe_module_specs import get_moe_module_spec
from mindformers.parallel_core.training_graph.device_matrix import layout
from mindformers.parallel_core.training_graph.transformer.moe.moe_layer import MoELayer


class MindFormersMoE(MoELayer):
    """(B, S, hidden) -> ((B, S, hidden), this layer's weighted router loss), by MindFormers 1.9's MoELayer.

    `transformer_config`: mindformers.parallel_core.transformer_config.TransformerConfig (the MoE keys and the
    parallel degrees). A subclass rather than a wrapper, so that its parameters are named as in MindFormers' own
    models (mlp.router.weight, mlp.experts.weight1, ...).
    """

    def __init__(self, transformer_config):
        config = transformer_config
        spec = get_moe_module_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                   use_interleaved_weight_layout_mlp=config.use_interleaved_weight_layout_mlp)
        # MindFormers' GPTModel initialises the dp/cp/tp layout its MoE layers' shard() reads (gpt_model.py:229); ours
        # has no GPTModel, so the block does it (MoELayer itself only initialises the expert layout, moe_layer.py:107)
        layout.init_layout(config)
        super().__init__(config, submodules=spec.submodules)
        self.to_sequence_first = ops.Transpose()
        self.to_batch_first = ops.Transpose()
        # Our activations are (B, S, hidden) with the batch split over data parallel (models/parallel.py); theirs
        # are (S, B, hidden) with the batch split over dp = data x tensor x context parallel (moe_layer.py:100).
        dp = config.data_parallel_size * config.tensor_model_parallel_size * config.context_parallel_size
        self.to_sequence_first.shard(((dp, 1, 1),))
        self.to_batch_first.shard(((1, dp, 1),))

    def construct(self, x, extra_loss=0., seq_chunk=None):
        out, _, router_loss = super().construct(self.to_sequence_first(x, (1, 0, 2)))
        return self.to_batch_first(out, (1, 0, 2)), router_loss


# Our per-expert tensors (models/shapes.py names) -> MindFormers' stacked ones, by layer {n}; the same layout as
# its ExpertsConvertOp writes from Hugging Face's (checkpoint/converter/convert_op.py:259-283) and, for the shared
# expert, its ConcatConvertOp (convert_op.py:186-225: gate and up rows interleaved, as SharedExpertMLPInterleaved
# reads them, transformer/mlp.py:210-225; one tensor-parallel rank, which MoE recipes have). tests/
# test_expert_parallel.py runs both converters as the reference.
ROUTER = ("model.layers.{n}.mlp.gate.weight", "model.layers.{n}.mlp.router.weight")
EXPERT = "model.layers.{n}.mlp.experts.{e}.{proj}.weight"
WEIGHT1, WEIGHT2 = "model.layers.{n}.mlp.experts.weight1", "model.layers.{n}.mlp.experts.weight2"
SHARED = "model.layers.{n}.mlp.shared_expert.{proj}.weight"
SHARED_FC1 = "model.layers.{n}.mlp.shared_experts.linear_fc1.weight"
RENAMED = (ROUTER,
           (SHARED.format(n="{n}", proj="down_proj"), "model.layers.{n}.mlp.shared_experts.linear_fc2.weight"),
           ("model.layers.{n}.mlp.shared_expert_gate.weight",
            "model.layers.{n}.mlp.shared_experts.shared_experts_gate.weight"))


def stack_experts(tensors: dict, cfg) -> dict:
    """Our checkpoint's tensors (numpy, by name) with every MoE layer in MindFormers' MoELayer names and layout:
    experts.weight1 (E*hidden, 2F) rows e*hidden.. = [gate_proj.T | up_proj.T], weight2 (E*F, hidden) = down_proj.T,
    the shared expert's linear_fc1 (2F', hidden) = gate and up rows interleaved."""
    out = dict(tensors)
    for n in range(cfg.num_layers):
        if not cfg.is_moe_layer(n):
            continue
        for ours, theirs in RENAMED:
            if ours.format(n=n) in out:
                out[theirs.format(n=n)] = out.pop(ours.format(n=n))

        def take(proj):
            return [out.pop(EXPERT.format(n=n, e=e, proj=proj)) for e in range(cfg.num_experts)]
        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        out[WEIGHT1.format(n=n)] = np.concatenate([np.concatenate([g.T, u.T], 1) for g, u in zip(gate, up)])
        out[WEIGHT2.format(n=n)] = np.concatenate([d.T for d in down])
        if cfg.shared_expert_intermediate_size:
            gate, up = (out.pop(SHARED.format(n=n, proj=p)) for p in ("gate_proj", "up_proj"))
            out[SHARED_FC1.format(n=n)] = np.stack([gate, up], 1).reshape(2 * gate.shape[0], gate.shape[1])
    return out


def unstack_experts(tensors: dict, cfg) -> dict:
    """stack_experts backwards."""
    out, hidden, width = dict(tensors), cfg.hidden_size, cfg.expert_size
    for n in range(cfg.num_layers):
        if not cfg.is_moe_layer(n):
            continue
        for ours, theirs in RENAMED:
            if theirs.format(n=n) in out:
                out[ours.format(n=n)] = out.pop(theirs.format(n=n))
        w1 = out.pop(WEIGHT1.format(n=n)).reshape(cfg.num_experts, hidden, 2 * width)
        w2 = out.pop(WEIGHT2.format(n=n)).reshape(cfg.num_experts, width, hidden)
        for e in range(cfg.num_experts):
            out[EXPERT.format(n=n, e=e, proj="gate_proj")] = np.ascontiguousarray(w1[e, :, :width].T)
            out[EXPERT.format(n=n, e=e, proj="up_proj")] = np.ascontiguousarray(w1[e, :, width:].T)
            out[EXPERT.format(n=n, e=e, proj="down_proj")] = np.ascontiguousarray(w2[e].T)
        if cfg.shared_expert_intermediate_size:
            fc1 = out.pop(SHARED_FC1.format(n=n))
            pairs = fc1.reshape(fc1.shape[0] // 2, 2, fc1.shape[1])
            out[SHARED.format(n=n, proj="gate_proj")] = np.ascontiguousarray(pairs[:, 0])
            out[SHARED.format(n=n, proj="up_proj")] = np.ascontiguousarray(pairs[:, 1])
    return out
