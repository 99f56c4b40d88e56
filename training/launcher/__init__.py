"""The launcher: runs on the host, checks before any worker starts, starts msrun, supervises and reports.

A one-process CPU run has no msrun: the launcher starts its worker itself (cluster.starts_worker_directly).
`cli` parses the command line and runs the steps in order: `cluster` (which node, which ranks, the msrun
or worker command), `preflight` and `versions` (the environment), `datasets` and `resume` (the data and the run
directory), `rendezvous` (the other nodes), `job` (the job's processes and the run directory's lock),
`supervision` (watching the ranks until the job ends) and `failure_report` (naming the first rank to fail).
"""
