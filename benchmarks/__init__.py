"""Benchmarks: scripts that print figures (never pass/fail). A package so that they share
``benchmarks._common`` (run with ``python benchmarks/<name>.py`` from the repository root)."""
