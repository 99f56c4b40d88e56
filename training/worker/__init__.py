"""The worker: runs on each rank (one process per device, under msrun; a one-process CPU run's alone, started by
the launcher) and trains through MindFormers' Trainer."""
