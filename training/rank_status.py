"""Per-rank heartbeat files: the launcher reads them to name a rank that stopped making progress."""

import os
import time

from ascend_llm_recipes.common.files import write_json_atomic
from ascend_llm_recipes.training.run_files import heartbeat_path


class Heartbeat:
    """RUN_DIR/heartbeat/rank_N.json: this rank's phase (start, setup, compile, step N, data, save, eval, done)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = heartbeat_path(run_dir, rank)
        self.rank = rank
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def beat(self, phase: str, step: int = 0) -> None:
        write_json_atomic(self.path, {"rank": self.rank, "phase": phase, "step": step, "time": time.time(),
                                      "pid": os.getpid()}, fsync=False)
