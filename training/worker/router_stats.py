"""What a Mixture-of-Experts model's routers did in a step: read from the model after the step, for the step record.

Each MoE layer (models/moe.py) adds, during the step's forward passes, the routing slots each expert took (after an
expert capacity's drops, model_config.capacity_factor) to its `expert_load` and its unweighted [load-balancing
loss, z-loss] to `router_losses`; after the step this reads and zeroes them (as MindFormers'
TopkBiasBalanceCallback does with its routers' expert_load, mindformers/core/callback/callback.py:2934-2950).
Under data parallel the ranks' counts are summed in StepRecorder's one host all-reduce (`values` / `from_sums`), so
every rank records and acts on the same numbers.

Per step it records, averaged over the MoE layers unless named per layer:
    load_balancing_loss  E * sum_e f_e * P_e (1.0 when the load is even; see models/moe.py)
    router_z_loss        mean logsumexp(router logits)^2
    expert_load          per layer, the busiest expert's slots over the mean (1.0 = even, E/k = every token)
    dropped_tokens       the fraction of the step's routing slots (token, expert) dropped by the experts' capacity
                         (0 when routing is dropless)
moves DeepSeek-V3's expert_bias towards an even load (when model_config.expert_bias_update_rate > 0), and warns of
a collapse (CollapseWatch): a layer whose k busiest experts took more than `collapse_factor` x their even share of
the routing slots over the last COLLAPSE_WINDOW steps, once, until the layer is back halfway to what a uniform
router shows.

On Ascend the MoE layers are MindFormers' MoELayer (models/expert_parallel.py): MindFormersRouterStats does there
what MindFormers' own callbacks do for its models after every step, which its trainer does not run for ours
(MFLossMonitor acts on MindFormers 1.9's own models only, core/callback/callback.py:487-492): zero the routers'
gbs_aux_loss accumulator fi_accu (callback.py:531-540, gpt_model.py:671-675), and move the correction bias from
the router's expert_load and zero it (GPTModel.update_topk_bias, gpt_model.py:623-641). Its router counts
expert_load only with the correction bias (router.py:163-178), and keeps no unweighted losses: the record then
has the load (when counted) and no loss terms.
"""

import functools
import sys
from collections import deque
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np


@dataclass(frozen=True)
class RouterRecord:
    load_balancing_loss: Optional[float]   # None: not counted (MindFormers' MoELayer)
    router_z_loss: Optional[float]
    expert_load: list         # per MoE layer: max / mean routing slots
    dropped_tokens: float


# A collapse is sustained: a router that sends a step's tokens to the same few experts and the next step's to others
# (an untrained tiny model's routers do, tokens' hidden states being alike) trains every expert; one that keeps
# sending them to the same experts starves the rest. The loads are judged summed over this many steps.
COLLAPSE_WINDOW = 10


def top_k_multiple(load: np.ndarray, top_k: int) -> float:
    """The share of the routing slots its `top_k` busiest experts took, over their even share top_k / E: 1.0 is even,
    E / top_k every token routed to the same top_k experts (a dropless router can do no worse)."""
    share = np.sort(load)[-top_k:].sum() / max(float(load.sum()), 1e-12)
    return float(share * len(load) / top_k)


@functools.lru_cache(maxsize=16)
def uniform_router(num_experts: int, top_k: int, tokens: int) -> tuple:
    """(mean, 99.9th percentile) of top_k_multiple for a router sending `tokens` tokens' top_k slots to experts
    uniformly at random: the chance imbalance a window of that many tokens shows. Each slot is drawn on its own (a
    multinomial); a real router's k distinct experts per token spread a little more evenly, so this errs towards
    no warning."""
    slots = np.random.default_rng(0).multinomial(tokens * top_k, np.full(num_experts, 1.0 / num_experts), size=2000)
    multiples = np.sort(slots, 1)[:, -top_k:].sum(1) / (tokens * top_k) * num_experts / top_k
    return float(multiples.mean()), float(np.quantile(multiples, 0.999))


class CollapseWatch:
    """Warns of a router collapse: a layer whose top_k busiest experts took more than `factor` x their even share of
    the routing slots summed over the last `window` steps, once, until the layer is back halfway to what a uniform
    router shows. The limit is `factor`, capped at 90% of the way from a uniform router's multiple to the most
    (E / k: the same k experts take every token), and never below what a uniform router reaches by chance over the
    window's tokens (its 99.9th percentile)."""

    def __init__(self, names: list, num_experts: int, top_k: int, factor: float, window: int = COLLAPSE_WINDOW):
        self.names, self.num_experts, self.top_k, self.factor = names, num_experts, top_k, factor
        self.steps = deque(maxlen=window)   # (loads (L x E), tokens) of the last steps
        self.collapsed: set = set()         # layers warned about, until they recover

    def limit(self, tokens: int) -> tuple:
        """(the collapse limit, a uniform router's mean multiple) for a window of `tokens` tokens."""
        uniform, chance = uniform_router(self.num_experts, self.top_k, tokens)
        most = self.num_experts / self.top_k
        return max(min(self.factor, uniform + 0.9 * (most - uniform)), chance), uniform

    def observe(self, step: int, loads: np.ndarray, tokens: int) -> None:
        """Take one step's loads (L x E, routing slots or fractions of them) of `tokens` tokens; warn as due."""
        if not self.factor:
            return
        self.steps.append((np.asarray(loads, np.float64), tokens))
        if len(self.steps) < self.steps.maxlen:
            return
        summed = sum(load for load, _ in self.steps)
        limit, uniform = self.limit(sum(t for _, t in self.steps))
        for name, load in zip(self.names, summed):
            multiple = top_k_multiple(load, self.top_k)
            if multiple > limit and name not in self.collapsed:
                self.collapsed.add(name)
                self.say(f"step {step}: router collapse in {name}: its {self.top_k} busiest experts took "
                         f"{multiple:.2f} x their even share of the routing slots over the last {len(self.steps)} "
                         f"steps (a uniform router: {uniform:.2f}; limit {limit:.2f}: anomaly.collapse_factor); raise "
                         "model_config.router_aux_loss_coef or lower the learning rate")
            elif multiple <= (uniform + limit) / 2 and name in self.collapsed:
                self.collapsed.discard(name)
                self.say(f"step {step}: {name}'s expert load is back under the limit ({multiple:.2f} x the even "
                         f"share over the last {len(self.steps)} steps)")

    @staticmethod
    def say(line: str) -> None:
        sys.stdout.write(f"[anomaly] {line}\n")
        sys.stdout.flush()


def router_stats(network, collapse_factor: float):
    """RouterStats for models/moe.py's layers, MindFormersRouterStats for MindFormers' MoELayer (Ascend)."""
    from ascend_llm_recipes.models.expert_parallel import MindFormersMoE

    if any(isinstance(cell, MindFormersMoE) for _, cell in network.cells_and_names()):
        return MindFormersRouterStats(network, collapse_factor)
    return RouterStats(network, collapse_factor)


class RouterStats:
    """The MoE layers of a network, read and zeroed after each step."""

    def __init__(self, network, collapse_factor: float):
        from ascend_llm_recipes.models.moe import MoE

        # named as their parameters are (model.layers.N.mlp), not by the train step's wrapper cells
        self.layers = [(cell.expert_load.name.rsplit(".", 1)[0], cell) for _, cell in network.cells_and_names()
                       if isinstance(cell, MoE)]
        if self.layers:
            moe = self.layers[0][1]
            self.num_experts, self.top_k = moe.num_experts, moe.router.top_k
            self.collapse = CollapseWatch([name for name, _ in self.layers], self.num_experts, self.top_k,
                                          collapse_factor)

    def values(self) -> np.ndarray:
        """This rank's counts since the last call, flattened [loads (L x E), losses (L x 2)]; zeroes them."""
        loads = [cell.expert_load.asnumpy().copy() for _, cell in self.layers]
        losses = [cell.router_losses.asnumpy().copy() for _, cell in self.layers]
        for _, cell in self.layers:
            cell.expert_load.set_data(ms.Tensor(np.zeros_like(loads[0])))
            cell.router_losses.set_data(ms.Tensor(np.zeros(2, np.float32)))
        return np.concatenate([np.concatenate(loads), np.concatenate(losses)]).astype(np.float32)

    def from_sums(self, sums: np.ndarray, ranks: int, tokens: int, step: int) -> RouterRecord:
        """The record from `values` summed over `ranks` data-parallel ranks, whose step took `tokens` tokens in all
        (one forward pass per rank and step: data parallel, no micro-batches)."""
        count = len(self.layers)
        loads = np.asarray(sums[:count * self.num_experts], np.float64).reshape(count, self.num_experts)
        losses = np.asarray(sums[count * self.num_experts:], np.float64).reshape(count, 2) / ranks
        slots = tokens * self.top_k
        ratios = loads.max(1) / np.maximum(loads.mean(1), 1e-12)
        self.collapse.observe(step, loads, tokens)
        self.update_expert_bias(loads)
        return RouterRecord(load_balancing_loss=float(losses[:, 0].mean()), router_z_loss=float(losses[:, 1].mean()),
                            expert_load=[round(float(r), 4) for r in ratios],
                            dropped_tokens=float(1.0 - loads.sum(1).mean() / slots))

    def update_expert_bias(self, loads: np.ndarray) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each layer's expert_bias += rate x sign(mean load - load).

        From the loads summed over every data-parallel rank, so every rank moves its copy the same way (Megatron-core
        _update_router_expert_bias and MindFormers' GPTModel.update_topk_bias, gpt_model.py:632-641, do the same);
        the slots taken after a capacity's drops, as megatron-core counts them (router.py:586-595, 629).
        """
        for (_, cell), load in zip(self.layers, loads):
            router = cell.router
            if router.expert_bias is None or not router.bias_update_rate:
                continue
            step = (router.bias_update_rate * np.sign(load.mean() - load)).astype(np.float32)
            router.expert_bias.set_data(ms.Tensor(router.expert_bias.asnumpy() + step))


class MindFormersRouterStats(RouterStats):
    """RouterStats for MindFormers' MoELayer (models/expert_parallel.py): its counters, its per-step resets.

    Semi-auto parallel computes one graph over the global batch, so its counters are already the global batch's
    on every rank; StepRecorder's host all-reduce multiplies them by the ranks, which neither the max/mean ratio
    nor the bias update's sign changes.
    """

    def __init__(self, network, collapse_factor: float):  # pylint: disable=super-init-not-called
        from ascend_llm_recipes.models.expert_parallel import MindFormersMoE

        self.layers = [(cell.router.weight.name.rsplit(".", 2)[0], cell) for _, cell in network.cells_and_names()
                       if isinstance(cell, MindFormersMoE)]
        config = self.layers[0][1].config
        self.num_experts, self.top_k = config.num_moe_experts, config.moe_router_topk
        self.collapse = CollapseWatch([name for name, _ in self.layers], self.num_experts, self.top_k,
                                      collapse_factor)
        self.counted = config.moe_router_enable_expert_bias   # router.expert_load exists (router.py:163-178)
        self.bias_update_rate = config.moe_router_bias_update_rate if self.counted else 0.0
        self.gbs = config.moe_router_load_balancing_type == "gbs_aux_loss"

    def values(self) -> np.ndarray:
        """[loads (L x E)] of this step, each the fraction of the routing slots per expert summed over the step's
        forward passes (router.py:371-377), or nothing when not counted; zeroes them and fi_accu."""
        loads = []
        for _, cell in self.layers:
            router = cell.router
            if self.gbs:
                router.fi_accu.set_data(ms.Tensor(np.zeros(router.fi_accu.shape, np.float32)))
            if self.counted:
                loads.append(router.expert_load.asnumpy().copy())
                router.expert_load.set_data(ms.Tensor(np.zeros_like(loads[-1])))
        return np.concatenate(loads).astype(np.float32) if loads else np.zeros(0, np.float32)

    def from_sums(self, sums: np.ndarray, ranks: int, tokens: int, step: int) -> RouterRecord:
        if not self.counted:
            return RouterRecord(load_balancing_loss=None, router_z_loss=None, expert_load=[], dropped_tokens=0.0)
        loads = np.asarray(sums, np.float64).reshape(len(self.layers), self.num_experts)
        ratios = loads.max(1) / np.maximum(loads.mean(1), 1e-12)
        self.collapse.observe(step, loads, tokens)
        self.update_expert_bias(loads)
        return RouterRecord(load_balancing_loss=None, router_z_loss=None,
                            expert_load=[round(float(r), 4) for r in ratios], dropped_tokens=0.0)

    def update_expert_bias(self, loads: np.ndarray) -> None:
        """router.expert_bias += rate x sign(mean load - load), as GPTModel.update_topk_bias (gpt_model.py:623-641)."""
        if not self.bias_update_rate:
            return
        for (_, cell), load in zip(self.layers, loads):
            bias = cell.router.expert_bias
            step = (self.bias_update_rate * np.sign(load.mean() - load)).astype(np.float32)
            bias.set_data(ms.Tensor(bias.asnumpy() + step))
