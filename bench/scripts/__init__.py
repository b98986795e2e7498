"""One-off measurements and figures behind the docs: run each from the repository root as
``python -m bench.scripts.NAME`` (bench/README.md lists them)."""
