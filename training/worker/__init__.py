"""The worker: runs on each rank under msrun (one process per device) and trains through MindFormers' Trainer."""
