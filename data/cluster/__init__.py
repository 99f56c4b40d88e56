"""Data preparation as N tasks on datatrove's executors (local processes, Slurm job arrays, Ray)."""
