"""Recipe loading, the MindFormers training entry point and the launcher.

Importing this package is cheap: MindSpore and MindFormers are imported only by the
modules that run training (`training.train`, `training.train_step`).
"""
