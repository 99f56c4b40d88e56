"""Training, split by who runs the code.

- `recipe/`: the typed recipe (schema, loading) and its translation to and from MindFormers' configs.
- `launcher/`: what runs on the host before and around the workers: the command line, preflight checks,
  dataset checks, resume, multi-node rendezvous, the job and its supervision.
- `worker/`: what runs on each rank (under msrun, or alone in a one-process CPU run): the MindFormers Trainer
  set-up, the train step, callbacks, the checkpointer, the anomaly monitor, the optimizer, metrics and collectives.
- `tools/`: what a user runs by hand: the memory/speed planner, plots, the Ascend acceptance kit, exports,
  checkpoint re-layout.
- Here: the run directory's on-disk format, shared by all of them (`run_files`, `rank_status`, `checkpoint`).

Importing this package is cheap: MindSpore and MindFormers are imported only by the worker modules
that run training (`worker.train`, `worker.train_step`).
"""
