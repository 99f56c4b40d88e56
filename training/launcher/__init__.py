"""The launcher: runs on the host, checks before any worker starts, starts msrun, supervises and reports."""
