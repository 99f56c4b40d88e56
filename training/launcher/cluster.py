"""The cluster this launcher is part of, and how its workers are started on its node.

`resolve_cluster` finds the node count, this node's rank and the master address: from the
command line, then Slurm's variables, then one node. Ranks are contiguous per node (node R runs
ranks R x local .. R x local + local - 1), so tensor-parallel groups stay on a node's links.
`job_command` and `worker_env` are the command and environment this node's job runs with: msrun
(`msrun_command`), or for a one-process CPU run the worker itself (`starts_worker_directly`).
"""

import os
import re
import socket
import sys
from dataclasses import dataclass

from ascend_llm_recipes.common.errors import LaunchError
from ascend_llm_recipes.training.launcher.job import DIRECT_WORKER_ENV
from ascend_llm_recipes.training.recipe.schema import Recipe
from ascend_llm_recipes.training.run_files import LOGS, MSRUN_LOG

# realpath: the package may be a symlink
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
WORKER_SCRIPT = os.path.join(REPO_ROOT, "scripts", "train.py")
MAX_MASTER_PORT = 65534  # the rendezvous listens on master_port + 1
DEFAULT_MULTINODE_PORT = 8118  # every node must name the same port; a random one cannot be shared
# What msrun sets for its cluster (mindspore/parallel/cluster/process_entity/_api.py:58-64, 79, 104-107):
# a worker started without msrun must not see them.
MSRUN_CLUSTER_ENV = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID", "MS_TOPO_TIMEOUT")


@dataclass
class Cluster:
    nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    local_workers: int
    world_size: int

    @property
    def ranks(self) -> range:
        """This node's ranks: contiguous, so tensor-parallel groups never span nodes."""
        start = self.node_rank * self.local_workers
        return range(start, start + self.local_workers)


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'gpu[03-06,09],login1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve_cluster(recipe: Recipe, nodes=None, node_rank=None, master_addr=None, master_port=None,
                    env=None) -> Cluster:
    """Node count, this node's rank and the master address, from arguments, then Slurm, then one node."""
    env = os.environ if env is None else env
    nodes = nodes if nodes is not None else _slurm_int(env, "SLURM_NNODES", 1)
    node_rank = node_rank if node_rank is not None else _slurm_int(env, "SLURM_NODEID", 0)
    if nodes < 1:
        raise LaunchError(f"--nodes {nodes}: the node count must be at least 1",
                          hint="pass the number of nodes the job runs on (under Slurm, SLURM_NNODES gives it)")
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"--node-rank {node_rank} must be in [0, {nodes}) for --nodes {nodes}",
                          hint="number the nodes 0 .. nodes-1, node 0 being the one at --master-addr")
    if master_port is not None and not 1 <= master_port <= MAX_MASTER_PORT:
        raise LaunchError(f"--master-port {master_port}: must be in [1, {MAX_MASTER_PORT}] (msrun's scheduler takes "
                          "it and the launchers' rendezvous the port after it)",
                          hint="pick a free port, the same on every node, e.g. the default "
                               f"{DEFAULT_MULTINODE_PORT}")
    if master_addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        master_addr = first_slurm_host(nodelist) if nodelist and nodes > 1 else "127.0.0.1"
    if master_port is None:
        master_port = DEFAULT_MULTINODE_PORT if nodes > 1 else free_port()
    world = recipe.world_size
    problems = []
    if world % nodes:
        problems.append(f"parallel_config: {world} devices (data x model x pipeline parallel) cannot be split "
                        f"evenly over {nodes} nodes")
    elif recipe.hardware.devices_per_node and world // nodes != recipe.hardware.devices_per_node:
        problems.append(f"hardware.devices_per_node: {recipe.hardware.devices_per_node}, but {world} devices over "
                        f"{nodes} node(s) is {world // nodes} per node; WORLD_SIZE must match the real devices "
                        "or HCCL initialisation hangs")
    if problems:
        raise LaunchError("; ".join(problems), hint="fix the parallel degrees or the node count before launching")
    return Cluster(nodes, node_rank, master_addr, master_port, world // nodes, world)


def _slurm_int(env, name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        raise LaunchError(f"{name}={env.get(name)!r} is not a whole number",
                          hint="run under a real Slurm allocation, or pass --nodes/--node-rank and unset it") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def starts_worker_directly(recipe: Recipe, cluster: Cluster) -> bool:
    """One worker on one node, on CPU: the launcher starts scripts/train.py itself, without msrun.

    msrun would add two processes that import MindSpore to such a run, msrun (~4.5 CPU-seconds) and the
    scheduler scripts/train.py becomes under MS_ROLE=MS_SCHED (~3.5): a tiny launch took ~28 CPU-seconds
    with them and ~21 without, for no collective (a single worker builds no communication group). Ascend
    jobs, even of one device, and every job of several workers or nodes keep msrun, which the Ascend path
    is proven with.
    """
    return cluster.world_size == 1 and cluster.nodes == 1 and recipe.context.device_target == "CPU"


def job_command(recipe: Recipe, cluster: Cluster, run_dir: str) -> list:
    """What the launcher starts on this node: msrun, or the worker itself (starts_worker_directly)."""
    if starts_worker_directly(recipe, cluster):
        return [sys.executable, WORKER_SCRIPT, "--run-dir", run_dir]
    return msrun_command(cluster, run_dir, binds_cores(recipe))


def msrun_log_name(cluster: Cluster) -> str:
    """logs/msrun.log, one per node when several nodes share the run directory."""
    return MSRUN_LOG if cluster.nodes == 1 else f"msrun.node_{cluster.node_rank}.log"


def msrun_command(cluster: Cluster, run_dir: str, bind_core: bool = False) -> list:
    """msrun run by this Python (its console script is mindspore.parallel.cluster.run:main).

    The `msrun` on PATH can belong to another installation: a pyenv shim, for one, runs it through
    `pyenv exec`, which puts pyenv's own bin first on PATH, and msrun starts each worker as plain
    `python` (mindspore/parallel/cluster/process_entity/_utils.py:104-106): the workers would then
    import another copy of ascend_llm_recipes than the launcher's, without a word.
    msrun echoes the log of this node's first rank only (every rank records the same agreed step, and
    several `tail -f` into one output interleave): each rank's own log is RUN_DIR/logs/worker_N.log.
    `bind_core` pins each worker to the CPU cores of its device's NUMA node: MindFormers starts every job
    with `msrun --bind_core=True` (scripts/msrun_launcher.sh of r1.8.0, lines 128 and 136); msrun derives
    the binding from the machine (mindspore/parallel/cluster/run.py:178-185). It is used on Ascend; on CPU
    the workers share the few cores through OMP_NUM_THREADS instead (worker_env).
    """
    return [sys.executable, "-m", "mindspore.parallel.cluster.run", *(["--bind_core=True"] if bind_core else []),
            f"--worker_num={cluster.world_size}",
            f"--local_worker_num={cluster.local_workers}",
            f"--master_addr={cluster.master_addr}", f"--master_port={cluster.master_port}",
            f"--node_rank={cluster.node_rank}", f"--log_dir={os.path.join(run_dir, LOGS)}", "--join=True",
            f"--tail_worker_log={cluster.ranks.start}", WORKER_SCRIPT, "--run-dir", run_dir]


def binds_cores(recipe: Recipe) -> bool:
    return recipe.context.device_target == "Ascend"


def worker_env(run_dir: str, local_workers: int, hccl: dict = None, direct: bool = False) -> dict:
    """Environment for msrun and its workers: identical HCCL settings on every rank, set before init.

    `direct`: for the worker the launcher starts itself (starts_worker_directly), which also gets what
    msrun would give it and the worker or MindFormers reads: RANK_ID, RANK_SIZE and DEVICE_ID
    (mindspore/parallel/cluster/process_entity/_api.py:254, 299, 307). Not MS_ROLE, nor the scheduler's
    address: with MS_ROLE set the worker would join a cluster (training/worker/train.py, MindSpore's
    init()) whose scheduler does not exist. DIRECT_WORKER_ENV marks it as the job's worker (job.py).
    """
    env = dict(os.environ, LOCAL_DEFAULT_PATH=run_dir)
    # msrun starts the workers as `python`: this Python, the one that imported this package.
    env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), os.environ.get("PATH")) if p)
    env.update(hccl or {})
    # msrun sets OMP_NUM_THREADS=1 unless it is already set, which halves CPU kernel speed
    # on a 2-core machine; share the cores between the local workers instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_workers)))
    if direct:
        for name in MSRUN_CLUSTER_ENV:  # e.g. a launcher started from inside another msrun job
            env.pop(name, None)
        env.update(RANK_ID="0", RANK_SIZE="1", DEVICE_ID="0", **{DIRECT_WORKER_ENV: "1"})
    return env
