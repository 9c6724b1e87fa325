"""The project's benchmarks, run from the checkout: `python -m bench.<name>` (results in bench/results/)."""
