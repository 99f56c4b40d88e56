"""Read back what a DryRun compile (training/tools/dryrun.py) produced, to hold it against what the project plans.

Three things MindSpore writes for a rank, each read with MindSpore's own reader where it has one:

- the strategy file (RUN_DIR/strategy/ckpt_strategy_rank_N.ckpt, a node_strategy.proto ParallelStrategyMap): per
  parameter of the rank's pipeline stage its device matrix, tensor map and optimizer-shard step and size; per
  operator that takes a parameter its strategy, and the stage. Read with mindspore.parallel.build_searched_strategy
  and sliced with the functions MindSpore's checkpoint transform cuts tensors with (mindspore/parallel/_tensor.py).
- the communication groups the rank created: MindSpore logs each at WARNING, so at the default log level
  (collective_manager.cc CreateCommunicationGroup, a C++ source not in the wheel: "Create collective communication
  group: NAME [const vector]{r0, r1}").
- the collectives of the compiled graph with their groups and shapes: comm_execute_order.csv, which the Ascend
  backend writes under RUN_DIR/rank_N/execute_order/ when it builds the kernel graph (collectives); read with
  mindspore/utils/runtime_execution_order_check.py RankFolderParser, MindSpore's checker of that file.

And what the layout implies: the DP, TP, PP and EP rank lists of a rank (expected_groups), which the project names
nowhere else as lists.
"""

import math
import os
import re
from dataclasses import dataclass

# Companions of a weight in the strategy file: AdamW's moments (mindformers/core/optim/adamw.py:167-168), the
# float32 masters of 16-bit weights (training/worker/optim.py), the pipeline's gradient accumulators
# (mindformers/wrapper/wrapper.py:849). Each is a clone of its weight and laid out like it.
COMPANIONS = ("adam_m.", "adam_v.", "master.", "accu_grads.")
_GROUP = re.compile(r"Create collective communication group: (\S+) \[const vector\]\{([\d, ]*)\}")


@dataclass
class ParameterLayout:
    """One parameter's entry in a strategy file."""

    name: str
    dev_matrix: tuple
    tensor_map: tuple
    opt_shard_step: int   # 0: not sliced by optimizer parallel
    opt_shard_size: int   # ranks sharing one optimizer slice; -1: every copy of the tensor-parallel slice

    @property
    def split(self) -> tuple:
        """How many parts each dimension is cut into (MindSpore's _get_tensor_strategy)."""
        from mindspore.parallel._tensor import _get_tensor_strategy

        return tuple(int(n) for n in _get_tensor_strategy(list(self.dev_matrix), list(self.tensor_map)))

    @property
    def optimizer_copies(self) -> int:
        """Over how many ranks optimizer parallel slices the parameter (1: it does not)."""
        from mindspore.parallel._tensor import _extract_layout_item

        if self.opt_shard_step == 0:
            return 1
        # -1 means all the ranks holding the same slice (mindspore/parallel/_tensor.py:341-350)
        _, _, _, size = _extract_layout_item([list(self.dev_matrix), list(self.tensor_map), [], 0,
                                              self.opt_shard_step, self.opt_shard_size])
        return int(size)

    def slice_shape(self, whole: tuple) -> tuple:
        """The slice of a `whole`-shaped parameter each rank's operators see (tensor and expert parallel)."""
        return tuple(d // s for d, s in zip(whole, self.split))

    def held_shape(self, whole: tuple) -> tuple:
        """What a rank stores: the slice, its first dimension split again over the optimizer copies, as MindSpore
        cuts it (mindspore/parallel/_tensor.py:529-543 _construct_tensor_layout_for_opt_shard: the optimizer
        split is of the first dimension, inside the model-parallel one)."""
        part = self.slice_shape(whole)
        return (part[0] // self.optimizer_copies, *part[1:]) if part else part

    def ranks_with_my_slice(self, rank: int, stage_ranks: range) -> list:
        """The ranks of the stage holding the same tensor-parallel slice as `rank` (its copies)."""
        return [r for r in stage_ranks if self._slice_index(r, stage_ranks) == self._slice_index(rank, stage_ranks)]

    def ranks_splitting_with_me(self, rank: int, stage_ranks: range) -> list:
        """The ranks whose slices, with `rank`'s, make up the whole tensor and differ from it only along the
        device-matrix axes the tensor is split over: rank's tensor-parallel group for a TP-split weight."""
        from mindspore.parallel._tensor import _rank_to_coordinate

        dev = list(self.dev_matrix)
        mine = _rank_to_coordinate(rank - stage_ranks.start, dev)
        split_axes = {len(dev) - 1 - d for d in self.tensor_map if d != -1}
        return [r for r in stage_ranks
                if all(c == m for axis, (c, m) in enumerate(zip(_rank_to_coordinate(r - stage_ranks.start, dev), mine))
                       if axis not in split_axes)]

    def _slice_index(self, rank: int, stage_ranks: range) -> int:
        from mindspore.parallel._tensor import _get_tensor_slice_index

        # ranks are numbered within the stage: the device matrix covers one stage (_parallel_serialization.py:303-305)
        return int(_get_tensor_slice_index(list(self.dev_matrix), list(self.split), list(self.tensor_map),
                                           rank - stage_ranks.start))


@dataclass
class StrategyFile:
    """A rank's strategy file: its stage, its parameters' layouts, the strategies of the operators taking them."""

    stage: int
    layouts: dict          # parameter name -> ParameterLayout
    operators: dict        # MindSpore's operator name (e.g. MatMul_model.layers.0.mlp.up_proj.weight) -> strategy

    def weights(self) -> dict:
        """The model's own parameters: the entries that are not an optimizer or accumulation companion."""
        return {n: l for n, l in self.layouts.items() if not n.startswith(COMPANIONS)}


def read_strategy(path: str) -> StrategyFile:
    """The strategy file MindSpore saved at `path` (strategy_ckpt_config save_file)."""
    from mindspore.parallel import build_searched_strategy
    from mindspore.parallel._parallel_serialization import _load_protobuf_strategy

    layouts = {}
    for name, layout in build_searched_strategy(path).items():
        # one tensor map per layout unless a dimension is split over two axes (_parallel_serialization.py:39-43),
        # which no strategy of ours does
        assert len(layout.tensor_map) == 1, (name, layout)
        layouts[name] = ParameterLayout(name, tuple(layout.dev_matrix[0].dim), tuple(layout.tensor_map[0].dim),
                                        int(layout.opt_weight_shard_step), int(layout.opt_weight_shard_size))
    items = _load_protobuf_strategy(path).parallel_strategy_item
    operators = {i.node_name: tuple(tuple(s.dim) for s in i.parallel_strategys.parallel_strategy) for i in items}
    # every operator of a rank's file is of its own stage (the merge reads the first one's: :216)
    stages = {i.parallel_strategys.stage for i in items}
    assert len(stages) == 1, stages
    return StrategyFile(stages.pop(), layouts, operators)


def created_groups(log: str) -> dict:
    """{group name: ranks} of every communication group the worker's log says MindSpore created."""
    with open(log, encoding="utf-8", errors="replace") as f:
        return {m.group(1): [int(r) for r in m.group(2).split(",") if r.strip()] for m in _GROUP.finditer(f.read())}


@dataclass
class Collective:
    """One collective of the rank's compiled graph."""

    primitive: str     # AllReduce, AllGather, ReduceScatter, Send, Receive, AlltoAll, ...
    group: str
    ranks: tuple
    input_shape: str
    output_shape: str


def collectives(run_dir: str, rank: int) -> list:
    """The collectives of `rank`'s kernel graph, in execution order, from the execute-order dump the Ascend backend
    writes under MS_DEV_SAVE_GRAPHS_PATH, by default the working directory, which dryrun.compile_rank makes the run
    directory (MindFormers rewrites MS_DEV_SAVE_GRAPHS from context.save_graphs, core/context/build_context.py:
    208-224, but this dump is written whatever it says)."""
    from mindspore.utils.runtime_execution_order_check import RankFolderParser

    folder = os.path.join(run_dir, f"rank_{rank}")
    _, orders = RankFolderParser(folder).parse_rank_folder(os.path.join(folder, "execute_order"), str(rank))
    if orders is None:
        raise FileNotFoundError(f"{folder}: no comm_execute_order.csv")
    return [Collective(o.primitive, o.group, tuple(int(r) for r in o.comm_rank), o.input_shape, o.output_shape)
            for o in orders]


def expected_groups(dp: int, tp: int, pp: int, rank: int, ep: int = 1) -> dict:
    """The rank lists of `rank`'s groups under DP x TP x PP (and EP): {"dp", "tp", "pp", "stage", "world"[, "ep"]}.

    - A pipeline stage holds consecutive ranks: stage = rank // (world / PP), as MindSpore numbers a stage's
      devices (mindspore/parallel/_parallel_serialization.py:303-305) and MindFormers builds its pipeline group,
      the ranks at the same place in every stage (mindformers/core/callback/callback.py:567-577).
    - Within a stage the device matrix is (DP, TP), TP last: the strategies (models/parallel.py) put DP on the
      first dimension of every operator and TP on the second, and MindSpore numbers the devices of a matrix with
      its last axis fastest (mindspore/parallel/_tensor.py:76-93 _rank_to_coordinate). So a TP group is TP
      consecutive ranks, a DP group DP ranks TP apart.
    - Expert parallel: EP consecutive ranks (mindformers/parallel_core/training_graph/transformer/moe/utils.py:
      58-64 get_ep_group_name).
    """
    per_stage = dp * tp
    stage, local = divmod(rank, per_stage)
    d, t = divmod(local, tp)
    base = stage * per_stage
    groups = {"dp": [base + i * tp + t for i in range(dp)], "tp": [base + d * tp + i for i in range(tp)],
              "pp": [local + s * per_stage for s in range(pp)], "stage": list(range(base, base + per_stage)),
              "world": list(range(per_stage * pp))}
    if ep > 1:
        groups["ep"] = list(range(rank // ep * ep, rank // ep * ep + ep))
    return groups


def layer_of(name: str):
    """The decoder layer a parameter belongs to (None: embedding, final norm, output projection)."""
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def held_bytes(layout: ParameterLayout, whole: tuple, itemsize: int) -> int:
    """Bytes of `layout`'s parameter this rank stores."""
    return math.prod(layout.held_shape(whole)) * itemsize


def expert_copies(dp: int, tp: int, pp: int, rank: int, ep: int) -> list:
    """The ranks of `rank`'s stage holding the same experts as it: one in each expert-parallel group of the stage, at
    rank's place in it (MindFormers' "dp mod ep" group, mindformers/parallel_core/training_graph/transformer/moe/
    utils.py:39-53). Optimizer parallel slices the experts' weights over them, as the other weights over the DP group.
    """
    stage = expected_groups(dp, tp, pp, rank)["stage"]
    return [r for r in stage if (r - stage[0]) % ep == (rank - stage[0]) % ep]
