"""The kernel variant table as kernels/launch.h defines it (enum Variant, kVariants), for tests
that run without a built library. The library serves the same rows through cudelta::variants;
tests read them from the header rather than repeat them."""

from __future__ import annotations

import re
from pathlib import Path

LAUNCH_H = Path(__file__).resolve().parents[2] / "kernels" / "launch.h"


def variant_rows(text: str | None = None) -> list[dict]:
    """[{"name": "warp", "id": 0, "min_arch": 0}, ...]: the rows csrc's variants() serves, in id order."""
    text = LAUNCH_H.read_text() if text is None else text
    enum = re.search(r"enum class Variant\s*:\s*int\s*\{(.*?)\};", text, re.S)
    table = re.search(r"kVariants\[\]\s*=\s*\{(.*?)\};", text, re.S)
    if not enum or not table:
        raise AssertionError(f"{LAUNCH_H} no longer has `enum class Variant` and `kVariants[]`: update this parser")
    ids = {m[1]: int(m[2]) for m in re.finditer(r"(k\w+)\s*=\s*(\d+)", enum[1])}
    rows = [{"name": m[2], "id": ids[m[1]], "min_arch": int(m[3])}
            for m in re.finditer(r"\{\s*Variant::(k\w+)\s*,\s*\"([^\"]+)\"\s*,\s*(\d+)\s*(?:,[^{}]*)?\}", table[1])]
    if not rows or len(rows) != len(ids):
        raise AssertionError(f"{LAUNCH_H}: {len(rows)} kVariants rows for {len(ids)} enumerators")
    return sorted(rows, key=lambda row: row["id"])


def variant_table() -> dict[str, int]:
    """{name: id}, as cudelta/_native.py builds it from the library's rows."""
    return {row["name"]: row["id"] for row in variant_rows()}
