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
and counters (router.fi_accu, router.expert_load), not weights. models/conversion/ours.py EXPERT_STACKS turns
our per-expert tensors into these and back (stack_moe_layers, unstack_moe_layers), as MindFormers' ExpertsConvertOp
and ConcatConvertOp do for Hugging Face checkpoints (mindformers/checkpoint/converter/convert_op.py:186-225, 259-283);
it lives with the converter, so that the converter and the load check read it without importing MindFormers.
`scripts/convert_checkpoint.py --expert-layout stacked` writes a checkpoint in it.

Executed here (tests/test_expert_parallel.py): these cells built on CPU inside our model (names, shapes), its
training graph compiled up to the router's TopkExt (Ascend-only), and the model built under semi-auto parallel by
two msrun CPU processes at DP 2 x EP 2 (expert-parallel groups, shard layouts). Not executed here: the forward,
whose TopkExt, GroupedMatmul and AllToAll have no CPU kernels; the acceptance kit (scripts/ascend_acceptance.sh)
runs it on Ascend against the CPU reference.
"""

from mindspore import ops

from mindformers.parallel_core.training_graph.base_models.gpt.moe_module_specs import get_moe_module_spec
from mindformers.parallel_core.training_graph.device_matrix import layout
from mindformers.parallel_core.training_graph.transformer.moe.moe_layer import MoELayer


class MindFormersMoE(MoELayer):
    """(B, S, hidden), router loss so far -> ((B, S, hidden), that plus this layer's weighted router loss), by
    MindFormers 1.9's MoELayer, which adds its router's loss to the one it is given (moe_layer.py:238).

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
        # Ours are (B, S, hidden) with the batch split over data parallel and whole on every tensor-parallel rank
        # (models/parallel.py); theirs (S, B, hidden) with the sequence split over tensor (and context) parallel
        # and the batch over data parallel: sequence parallel, which its MoE layer runs with tensor parallel
        # (moe_layer.py:143-147, 234-240; mindformers_mcore_export.py moe_transformer_config). Into it, each TP rank
        # keeps its part of the sequence (no communication); out of it, the parts are gathered for our next layer.
        dp, sp = config.data_parallel_size, config.tensor_model_parallel_size * config.context_parallel_size
        self.to_sequence_first.shard(((dp, sp, 1),))
        self.to_batch_first.shard(((sp, dp, 1),))

    def construct(self, x, extra_loss=0., seq_chunk=None):
        out, _, router_loss = super().construct(self.to_sequence_first(x, (1, 0, 2)), extra_loss)
        return self.to_batch_first(out, (1, 0, 2)), router_loss
