"""The release tooling: the matrix, the build of a cell, the wheel checks, the release assets and the
local dry run. Run from the repository root as `python -m release.<tool>` (e.g. `python -m
release.dry_run --out DIR`); it imports `installer` as the package it is. Never installed and never
in the sdist (pyproject.toml lists the `cudelta` package only; MANIFEST.in grafts installer/).
"""
