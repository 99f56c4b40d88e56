"""The Mixture-of-Experts feed-forward block as MindSpore Cells: router, experts, shared expert, load terms.

Reads like the papers it follows: a softmax router picks each token's top-k of E SwiGLU experts (Shazeer et al.
2017; Mixtral, Jiang et al. 2024; Qwen2-MoE and Qwen3-MoE), whose outputs are summed with the router's
probabilities as weights, renormalised over the k chosen when `norm_topk_prob` (Mixtral, Qwen3-MoE); an
optional shared expert sees every token, scaled by its own sigmoid gate in Qwen2-MoE (DeepSeekMoE, Dai et al.
2024). Two terms keep the router healthy, each summed over the MoE layers into the loss with its coefficient:

    load balancing (Switch Transformer, Fedus et al. 2021)  E * sum_e f_e * P_e, f_e the fraction of the
        T*k routing slots of this layer's T tokens of the global batch that went to expert e (sum_e f_e = 1,
        summed over data-parallel ranks, or each rank's own: LoadBalancingLoss), P_e the mean router probability
        of e. 1.0 when the load is even. Megatron-core's switch_load_balancing_loss_func and
        MindFormers' per-layer normalisation; transformers' load_balancing_loss_func counts f_e per token
        (sum_e = k) over all layers' tokens at once, so for one layer it is k times this.
    router z-loss (ST-MoE, Zoph et al. 2022)  mean over tokens of logsumexp(router logits)^2.

Routing is dropless, every token reaching its top k experts, unless the config sets a capacity_factor: then each
expert takes at most ceil(T*k / E * capacity_factor) of a forward pass's T*k routing slots and the others are
dropped, as megatron-core's apply_router_token_dropping drops them (ExpertCapacity). Static shapes (graph mode)
cannot size a buffer per expert by its token count, so MoE.dispatch picks how the tokens meet their experts, each
giving the same numbers (tests/test_moe.py):
    "sorted" (the default)  the T*k routing slots sorted by expert into blocks of `block` rows, each expert's
        run padded to whole blocks (MegaBlocks, Gale et al. 2022): at most T*k + E*block rows, a static bound, so
        one BatchMatMul over the blocks with each block's expert weights computes only the routed tokens
    "stacked"  every expert computes every token, one BatchMatMul over the stacked expert weights (E/k x FLOPs)
    "loop"     every expert computes every token, one Cell per expert (the reference math, E/k x the FLOPs)
scripts/benchmark_training.py --shapes moe measures them. Parameters are named as Hugging Face's Qwen2/Qwen3-MoE
checkpoints name them (mlp.gate, mlp.experts.{e}.gate_proj, mlp.shared_expert, mlp.shared_expert_gate), so
conversion is a table.
"""

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from mindspore.ops.auto_generate.gen_ops_prim import SiLU

from ascend_llm_recipes.models.arithmetic import expert_capacity
from ascend_llm_recipes.models.layers import DTYPES, MLP, Linear


class Router(nn.Cell):
    """Router logits (T, E) -> (combine weights (T, E), zero outside each token's top k; the probabilities the
    load-balancing loss reads; the top-k selection (T, E) in {0, 1}; the chosen experts (T, k), best first).
    Float32 whatever the compute dtype.

    softmax (Mixtral, Qwen-MoE): the top k of softmax(logits), weighted by their probabilities, renormalised to
    sum to 1 when norm_topk_prob. sigmoid (DeepSeek-V3, transformers' DeepseekV3TopkRouter): scores
    sigmoid(logits); the top k chosen by scores + expert_bias among the experts of the topk_group best of n_group
    groups (a group scored by its two best), weighted by their scores (renormalised when norm_topk_prob), times
    routed_scaling_factor; the load-balancing loss reads the scores normalised per token (Megatron-core's
    compute_routing_scores_for_aux_loss).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.sigmoid_scores = config.router_score == "sigmoid"
        self.groups, self.top_groups = config.n_group, config.topk_group
        # DeepSeek-V3's score-correction bias: not trained; moved towards an even load after every step
        # (training/worker/router_stats.py), as MindFormers' router.expert_bias (router.py, TopkBiasBalanceCallback).
        self.expert_bias = (Parameter(initializer("zeros", (config.num_experts,), ms.float32), name="expert_bias",
                                      requires_grad=False) if config.expert_bias else None)
        self.bias_update_rate = config.expert_bias_update_rate
        self.softmax = ops.Softmax(-1)
        self.sigmoid = ops.Sigmoid()
        self.topk = ops.TopK(sorted=True)
        self.group_topk = ops.TopK(sorted=True)
        self.one_hot = ops.OneHot(-1)
        self.chosen_sum = ops.ReduceSum()
        self.mul = ops.Mul()
        self.weight_sum = ops.ReduceSum(keep_dims=True)
        self.div = ops.Div()

    def one_hot_sum(self, indices, depth: int):
        """(T, n) indices -> (T, depth) in {0, 1}."""
        one, zero = ops.scalar_to_tensor(1.0, ms.float32), ops.scalar_to_tensor(0.0, ms.float32)
        return self.chosen_sum(self.one_hot(indices, depth, one, zero), 1)

    def group_mask(self, choice):
        """(T, E) -> (T, E): 1 for the experts of each token's topk_group best groups, scored by their best two."""
        t = choice.shape[0]
        per_group = self.num_experts // self.groups
        # (T, E) -> (T, groups, experts per group) -> (T, groups)
        best_two = self.group_topk(choice.reshape(t, self.groups, per_group), 2)[0]
        _, groups = self.group_topk(best_two.sum(-1), self.top_groups)                # (T, topk_group)
        mask = self.one_hot_sum(groups, self.groups)                                   # (T, groups)
        # (T, groups) -> (T, groups, experts per group) -> (T, E)
        return ops.tile(mask.reshape(t, self.groups, 1), (1, 1, per_group)).reshape(t, self.num_experts)

    def construct(self, logits):
        if self.sigmoid_scores:
            scores = self.sigmoid(logits)
            probs = self.div(scores, self.weight_sum(scores, -1) + 1e-20)               # for the balancing loss
        else:
            scores = probs = self.softmax(logits)
        choice = ops.stop_gradient(scores)
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        if self.groups > 1:
            choice = self.mul(choice, self.group_mask(choice))  # other groups' experts score 0, as transformers'
        _, chosen = self.topk(choice, self.top_k)                                      # (T, k) expert indices
        selected = self.one_hot_sum(chosen, self.num_experts)                          # (T, E) in {0, 1}
        weights = self.mul(scores, selected)
        if self.norm_topk_prob:
            total = self.weight_sum(weights, -1)
            weights = self.div(weights, total + 1e-20 if self.sigmoid_scores else total)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights, probs, selected, chosen


class ExpertCapacity(nn.Cell):
    """(combine weights (T, E), top-k selection (T, E), batch, seq) -> (the weights and selection of the slots each
    expert has room for: at most expert_capacity per expert, the others 0).

    megatron-core 0.16.1's apply_router_token_dropping (moe_utils.py:800-863), called by TopKRouter.routing after
    the top k (router.py:586-595): per expert, "probs" keeps the slots of the largest combine weights, "position"
    the earliest in megatron's token order, its hidden states being (S, B, hidden): sequence position first, then
    batch row, as its TransformerConfig documents the policy (megatron-core itself picks them by torch.topk over the
    0/1 map, whose order among equal values torch leaves unspecified: on CPU not the earliest, the number kept per
    expert the same). The kept slots keep their weights, not renormalised (final_probs = routing_probs *
    final_map); a dropped slot weighs 0, so its expert's output is not added and no gradient reaches that expert or
    the router through it. Megatron's moe_pad_expert_input_to_capacity is left out: its weight-0 padding changes the
    dispatch shapes, not the numbers (only its expert-bias count, which models/conversion/megatron.py refuses).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.factor, self.by_probs = config.capacity_factor, config.token_drop_policy == "probs"
        self.topk = ops.TopK(sorted=False)
        self.scatter = ops.TensorScatterElements(axis=1)
        self.cumsum = ops.CumSum()
        self.mul = ops.Mul()

    def construct(self, weights, selected, batch: int, seq: int):
        t, e = weights.shape
        capacity = expert_capacity(t, self.top_k, self.num_experts, self.factor)
        if capacity >= t:
            return weights, selected  # every expert has room for every token
        if self.by_probs:
            # (T, E) -> (E, T): each expert's `capacity` tokens of the largest weights (E, capacity)
            _, tokens = self.topk(ops.transpose(ops.stop_gradient(weights), (1, 0)), capacity)
            room = self.scatter(ops.zeros((e, t), ms.float32), tokens, ops.ones((e, capacity), ms.float32))
            room = ops.transpose(room, (1, 0))                                           # (T, E)
        else:
            # (B*S, E) -> (S*B, E) megatron's order; the running count of each expert's slots; back to (B*S, E)
            order = ops.transpose(selected.reshape(batch, seq, e), (1, 0, 2)).reshape(t, e)
            room = (self.cumsum(order, 0) <= capacity).astype(ms.float32)
            room = ops.transpose(room.reshape(seq, batch, e), (1, 0, 2)).reshape(t, e)
        kept = self.mul(selected, room)
        return self.mul(weights, kept), kept


class LoadBalancingLoss(nn.Cell):
    """E * sum_e f_e * P_e of one layer (see the module docstring) from its probabilities and top-k selection.

    `scope` (model_config.router_aux_loss_scope) says which routing slots f_e counts. "global": those of the whole
    global batch (global-batch balancing, as Qwen3 trains; megatron-core's global_aux_loss): in data-parallel mode,
    where each rank runs its own graph on its slice of the batch, the ranks' counts are summed first, so the loss
    and its gradient averaged over the ranks are one process's on the whole batch (f_e takes no gradient; P_e is
    the rank's own mean, which the gradient average combines), whatever the data-parallel degree. With several
    forward passes per step (pipeline micro-batches, gradient accumulation: Ascend, where the MoE layers are
    MindFormers' gbs_aux_loss, models/expert_parallel.py) f_e is the mean of the step's passes so far, as
    megatron-core's global_aux_loss takes it (transformer/moe/router.py:392-394); on CPU a step is one pass.
    "micro_batch": each rank's own slots (megatron-core's aux_loss, MindFormers' seq_aux_loss), so the
    objective depends on the data-parallel degree.
    """

    def __init__(self, num_experts: int, top_k: int, scope: str = "global"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.ranks = data_parallel_ranks() if scope == "global" else 1
        self.sum_over_ranks = ops.AllReduce() if self.ranks > 1 else None
        self.sum_over_tokens = ops.ReduceSum()
        self.mean_over_tokens = ops.ReduceMean()
        self.mul = ops.Mul()
        self.sum = ops.ReduceSum()

    def construct(self, probs, selected):
        slots = self.sum_over_tokens(selected, 0)                                 # (E,) this rank's
        if self.sum_over_ranks is not None:
            slots = self.sum_over_ranks(ops.stop_gradient(slots))                 # (E,) the global batch's
        fraction = slots / (selected.shape[0] * self.ranks * self.top_k)         # (E,), sums to 1
        mean_prob = self.mean_over_tokens(probs, 0)                               # (E,)
        return self.sum(self.mul(fraction, mean_prob)) * self.num_experts


def data_parallel_ranks() -> int:
    """How many ranks each run their own graph on a slice of the batch: the world in data-parallel mode, else 1
    (stand-alone; semi-auto parallel compiles one graph over the whole batch and reduces across ranks itself)."""
    if ms.get_auto_parallel_context("parallel_mode") != "data_parallel":
        return 1
    from mindspore.communication import get_group_size

    return get_group_size()


class ZLoss(nn.Cell):
    """mean over tokens of logsumexp(router logits)^2."""

    def __init__(self):
        super().__init__()
        self.max = ops.ReduceMax(keep_dims=True)
        self.sub = ops.Sub()
        self.exp = ops.Exp()
        self.sum = ops.ReduceSum()
        self.log = ops.Log()
        self.add = ops.Add()
        self.square = ops.Square()
        self.mean = ops.ReduceMean()

    def construct(self, logits):
        top = ops.stop_gradient(self.max(logits, -1))                               # (T, 1), for stability
        logsumexp = self.add(self.log(self.sum(self.exp(self.sub(logits, top)), -1)), top.reshape(-1))
        return self.mean(self.square(logsumexp))


def block_rows(slots: int, num_experts: int) -> int:
    """Rows of a "sorted" dispatch block: a multiple of 16 with num_experts blocks of padding at most ~1/4 of the
    slots (the padding is computed: the buffer's rows are fixed at its bound), at least 16."""
    return max(16, slots // (4 * num_experts) // 16 * 16)


class SortedExperts(nn.Cell):
    """Each routing slot's token through its expert only: (T, hidden), top-k experts (T, k) and their weights (T, k),
    the experts' stacked gate/up (E, F, hidden) and down (E, hidden, F) weights -> (T, hidden) weighted sums.

    The T*k slots are sorted by expert and laid out in blocks of `block` rows, each expert's run starting a new
    block; the rows past a run's end read a zero token and carry weight 0. T*k + E*block rows bound the layout
    whatever the routing, so every shape is static and no token is dropped (a slot an expert capacity dropped keeps
    its row, with weight 0).
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.sort = ops.Sort()
        self.cumsum = ops.CumSum()
        self.scatter = ops.TensorScatterUpdate()
        self.gather = ops.Gather()
        self.up_matmul = ops.BatchMatMul(transpose_b=True)
        self.down_matmul = ops.BatchMatMul(transpose_b=True)
        self.silu = SiLU()
        self.mul = ops.Mul()
        self.weigh = ops.Mul()

    def layout(self, experts, slots: int, block: int, blocks: int):
        """(slots,) expert of each slot -> (row of each slot in the blocks (slots,), slot of each row or `slots`
        for padding (rows,), expert of each block (blocks,))."""
        position = ops.arange(slots, dtype=ms.int32)
        # expert-major, slot order within an expert; exact in float32 below 2^24
        _, order = self.sort((experts * slots + position).astype(ms.float32))       # sorted position -> slot
        sorted_experts = self.gather(experts, order, 0)
        counts = ops.one_hot(experts, self.num_experts, ops.ones((), ms.int32), ops.zeros((), ms.int32)).sum(0)
        padded = (counts + block - 1) // block * block                                 # (E,) whole blocks
        ends, padded_ends = self.cumsum(counts, 0), self.cumsum(padded, 0)
        row = (self.gather(padded_ends - padded, sorted_experts, 0) + position
               - self.gather(ends - counts, sorted_experts, 0)).astype(ms.int32)       # sorted position -> row
        order = order.astype(ms.int32)
        slot_row = self.scatter(ops.zeros((slots,), ms.int32), order.reshape(slots, 1), row)
        row_slot = self.scatter(ops.fill(ms.int32, (blocks * block,), slots), row.reshape(slots, 1), order)
        block_start = ops.arange(blocks, dtype=ms.int32) * block
        block_expert = (padded_ends.reshape(1, -1) <= block_start.reshape(-1, 1)).astype(ms.int32).sum(1)
        return slot_row, row_slot, ops.minimum(block_expert, self.num_experts - 1)  # trailing blocks: any expert

    def construct(self, tokens, chosen, weights, gate_up, down):
        t, h = tokens.shape
        k = chosen.shape[1]
        slots = t * k
        block = block_rows(slots, self.num_experts)
        blocks = -(-slots // block) + self.num_experts - 1  # sum over experts of ceil(count / block) is at most this
        slot_row, row_slot, block_expert = self.layout(chosen.reshape(slots), slots, block, blocks)
        padded_tokens = ops.concat((tokens, ops.zeros((1, h), tokens.dtype)))        # row t: the padding's token
        # (rows,) -> (rows, hidden) -> (blocks, block, hidden): slot s is token s // k
        x = self.gather(padded_tokens, row_slot // k, 0).reshape(blocks, block, h)
        gate, up = ops.split(self.up_matmul(x, self.gather(gate_up, block_expert, 0)), gate_up.shape[1] // 2, -1)
        y = self.down_matmul(self.mul(self.silu(gate), up), self.gather(down, block_expert, 0))  # (blocks, block, h)
        y = self.gather(y.reshape(blocks * block, h), slot_row, 0)                     # (slots, hidden)
        return self.weigh(y, weights.reshape(slots, 1)).reshape(t, k, h).sum(1)


class MoE(nn.Cell):
    """The MoE MLP of one decoder layer: (B, S, hidden), router loss so far -> ((B, S, hidden), that plus this
    layer's weighted router loss): the decoder carries the sum through its layers (models/llama.py LlamaModel), as
    MindFormers' MoELayer adds its router's loss to the one it is given (moe_layer.py:238)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.compute_dtype = DTYPES[config.compute_dtype]
        # The router's projection, named `gate` as in the HF checkpoints (mlp.gate.weight (E, hidden)), float32.
        self.gate = Linear(config.hidden_size, config.num_experts, config.initializer_range)
        self.router = Router(config)
        self.experts = nn.CellList([MLP(config, config.expert_size) for _ in range(config.num_experts)])
        self.dispatch = "sorted"  # or "stacked", "loop": the same numbers (the module docstring); read at compile
        self.sorted_experts = SortedExperts(config.num_experts)
        self.capacity = ExpertCapacity(config) if config.capacity_factor else None
        self.take = ops.GatherD()
        self.expert_matmul = ops.BatchMatMul(transpose_b=True)
        self.silu = SiLU()
        self.shared_expert = (MLP(config, config.shared_expert_intermediate_size)
                              if config.shared_expert_intermediate_size else None)
        self.shared_expert_gate = (Linear(config.hidden_size, 1, config.initializer_range,
                                          compute_dtype=self.compute_dtype, param_dtype=DTYPES[config.param_dtype])
                                   if config.shared_expert_gate else None)
        self.sigmoid = ops.Sigmoid()
        self.shared_mul = ops.Mul()
        self.combine_mul = ops.Mul()
        self.add = ops.Add()
        self.aux_coef, self.z_coef = config.router_aux_loss_coef, config.router_z_loss_coef
        self.load_balancing = LoadBalancingLoss(config.num_experts, config.num_experts_per_tok,
                                                config.router_aux_loss_scope)
        self.z_loss = ZLoss()
        # What the training loop reads (and zeroes) after every step (training/worker/router_stats.py), summed over the
        # step's forward passes: the routing slots each expert took (after the capacity's drops: the slots it
        # computed, as megatron-core counts them for its expert bias, router.py:629), and [load-balancing loss,
        # z-loss] unweighted.
        # Not trained; added in place and never recomputed, as MindFormers' router keeps its expert_load
        # (mindformers/parallel_core/training_graph/transformer/moe/router.py:173-178, 379-386).
        self.expert_load = Parameter(initializer("zeros", (config.num_experts,), ms.float32), name="expert_load",
                                     requires_grad=False)
        self.router_losses = Parameter(initializer("zeros", (2,), ms.float32), name="router_losses",
                                       requires_grad=False)
        self.count_slots = ops.ReduceSum()
        self.stack = ops.Stack()
        self.add_load = ops.AssignAdd()
        self.add_load.recompute(False)
        self.add_losses = ops.AssignAdd()
        self.add_losses.recompute(False)

    def construct(self, x, router_loss=0.0):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        logits = self.gate(tokens.astype(ms.float32))                                # (T, E)
        weights, probs, selected, chosen = self.router(logits)
        kept = selected
        if self.capacity is not None:
            weights, kept = self.capacity(weights, selected, b, s)
        weights = weights.astype(self.compute_dtype)
        if self.dispatch == "sorted":
            out = self.sorted_experts(tokens, chosen, self.take(weights, 1, chosen), *self.stacked_weights())
        elif self.dispatch == "stacked":
            out = self.every_expert_stacked(tokens, weights)
        else:
            out = self.every_expert_loop(tokens, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = self.shared_mul(shared, self.sigmoid(self.shared_expert_gate(tokens)).astype(shared.dtype))
            out = self.add(out, shared)
        # the balancing loss reads the top k before any drop, as megatron-core's (router.py:598-626)
        balance, z = self.load_balancing(probs, selected), self.z_loss(logits)
        self.add_load(self.expert_load, ops.stop_gradient(self.count_slots(kept, 0)))              # (E,)
        self.add_losses(self.router_losses, ops.stop_gradient(self.stack((balance, z))))
        return out.reshape(b, s, h), router_loss + (balance * self.aux_coef + z * self.z_coef)

    def stacked_weights(self):
        """The experts' weights as (E, 2F, hidden) gate and up rows, and (E, hidden, F) down, in compute dtype."""
        gate_up = ops.stack([ops.concat((e.gate_proj.weight, e.up_proj.weight)) for e in self.experts])
        down = ops.stack([e.down_proj.weight for e in self.experts])
        return gate_up.astype(self.compute_dtype), down.astype(self.compute_dtype)

    def every_expert_stacked(self, tokens, weights):
        """Every expert on every token in one BatchMatMul per projection, combined with the (T, E) weights."""
        gate_up, down = self.stacked_weights()
        e, t, h = gate_up.shape[0], tokens.shape[0], tokens.shape[1]
        # (T, hidden) -> (E, T, hidden) -> (E, T, 2F) -> two (E, T, F)
        both = self.expert_matmul(ops.broadcast_to(tokens, (e, t, h)), gate_up)
        gate, up = ops.split(both, gate_up.shape[1] // 2, -1)
        y = self.expert_matmul(self.combine_mul(self.silu(gate), up), down)                # (E, T, hidden)
        return self.combine_mul(y, ops.transpose(weights, (1, 0)).reshape(e, t, 1)).sum(0)

    def every_expert_loop(self, tokens, weights):
        """Every expert Cell on every token, scaled by each token's weight for it (0 outside its top k)."""
        out = None
        for e, expert in enumerate(self.experts):
            contribution = self.combine_mul(expert(tokens), weights[:, e:e + 1])          # (T, hidden)
            out = contribution if out is None else self.add(out, contribution)
        return out
