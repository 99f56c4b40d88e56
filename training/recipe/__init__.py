"""The recipe: typed sections (schema.py, device.py), loading and overrides (loading.py), the one translation
to and from MindFormers (mindformers.py, mindformers_import.py), and the data loader's inputs (loader_spec.py)."""
