"""The run directory's files, named in one place: what a run's output_dir holds.

RUN_DIR/
  recipe.yaml              the resolved recipe the run trains with (a resume compares against it)
  amendments.jsonl         recipe changes accepted on resume with --amend, one per line
  preflight.json, .txt     the launcher's environment checks
  launch.lock              held by the launcher that owns the run (node 0's on several nodes)
  rendezvous.json          on several nodes: node 0's record of the nodes it admitted (training/launcher/rendezvous.py)
  status/rank_N.json       each rank's state: running, done or failed (format: training/rank_status.py)
  heartbeat/rank_N.json    each rank's phase, for the launcher's hang detection (format: training/rank_status.py)
  metrics.jsonl            rank 0's per-step records (metrics_rank_N.jsonl: another rank's)
  summary.json             rank 0's end-of-run summary
  data_skips.json          samples left out after a loss-spike rollback (named by data/loader.py SKIPS_FILE:
                           the data layer reads it and sits below training/)
  checkpoints/step_N/      one step's checkpoint (training/checkpoint.py names what is inside)
  checkpoints/invalid/     step directories set aside by a resume, each with a REASON.txt
  resume_links/step_N/rank_R/  on a resume at a higher data-parallel degree: a new rank's link to rank 0's
                           file, under the name MindFormers looks for (remade by every launch)
  logs/                    each worker's log, and msrun.log and scheduler.log (none in a one-process CPU run,
                           started without msrun)
  tensorboard/, profile/rank_N/
  strategy/                each rank's parallel-strategy file (semi-auto runs; training/tools/relayout.py)
  checkpoints/step_N/strategy/, layout.json   the strategy files a relayout resume re-slices from, kept
  merged_checkpoint/step_N/  a TP/PP step merged into one unsliced checkpoint for --to-hf
  checkpoint/, log/        made by MindFormers' Trainer in its output_dir (ours are above); checkpoint/ and
                           strategy/ left empty are removed by the launcher when the job ends
"""

import os

RESOLVED_RECIPE = "recipe.yaml"
AMENDMENTS = "amendments.jsonl"
PREFLIGHT_JSON = "preflight.json"
PREFLIGHT_TXT = "preflight.txt"
LOCK_FILE = "launch.lock"
STATUS = "status"
HEARTBEAT = "heartbeat"
METRICS = "metrics.jsonl"
METRICS_PATTERN = "metrics*.jsonl"  # every rank's metrics file
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
INVALID = "invalid"
RESUME_LINKS = "resume_links"
REASON = "REASON.txt"
LOGS = "logs"
MSRUN_LOG = "msrun.log"
TENSORBOARD = "tensorboard"
PROFILE = "profile"
STRATEGY_DIR = "strategy"
LAYOUT_FILE = "layout.json"
MERGED_DIR = "merged_checkpoint"
MINDFORMERS_DIRS = ("checkpoint", "strategy", "log")


def metrics_file(rank: int) -> str:
    """Rank 0's per-step records are the run's metrics; other ranks keep their own (local loss)."""
    return METRICS if rank == 0 else f"metrics_rank_{rank}.jsonl"


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, STATUS, f"rank_{rank}.json")


def heartbeat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, HEARTBEAT, f"rank_{rank}.json")


def worker_log(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LOGS, f"worker_{rank}.log")
