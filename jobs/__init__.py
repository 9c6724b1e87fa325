"""Command-line jobs: `python -m jobs.<name>` (or `python jobs/<name>.py` with the project installed)."""
