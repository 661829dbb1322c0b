"""The build record, `cudelta/_build_info.json`: what a build compiled, read by everything after it.

Written once, by installer/compile/build_record.py, beside the library (and embedded in it: the
`cudelta::build_info` op returns the same JSON). Read only through `parse` here: by the loader
(cudelta/_native.py) before dlopen, by `python -m cudelta`, by the release tooling
(release/make_release.py: the manifest) and by the wheel checks (release/check_wheel.py).
Standard library only, and no import of the package: build tooling loads this file by path,
where torch may not be installed.

Schema 2, written by this source:

    schema              2
    version             package version built, '0.1.0'
    cuda_label          'cu130': the release wheel's local version label (and its index folder)
    cuda_toolkit        nvcc's 'major.minor'
    archs / ptx         cubins ['sm_80', 'sm_90a', ...] / PTX ['compute_120'] in the library
    torch_built_with    the torch compiled against; torch_floor: the oldest torch it loads under
    python_floor        '3.10'
    driver_floor        the oldest driver CUDA version that runs it
    git_revision        of the source; build: 'release' | 'local'; fatbin_compression: bool

Schema 1 is the same record without `schema`, its label under `variant` (a name that collided
with the kernel variants). It is still read, and normalised to schema 2: the release tooling may
meet wheels built before the field existed, and the tests' hand-made wheels are such records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Tuple

SCHEMA = 2
FILENAME = "_build_info.json"
# The commands that replace an unusable install, pip's and uv's: the loader's messages
# (cudelta/_native.py), `python -m cudelta` and, through build_info.h (installer/compile/build_record.py),
# the library's own (csrc/ops.cpp). They touch cudelta only: without --no-deps a forced reinstall
# also reinstalls torch (gigabytes, and PyPI's default build in place of a +cuXYZ one). Without
# the cache, pip and uv build the sdist again rather than reuse a wheel built for another machine.
# `{env}` is where variables for the build go (FORCE_BUILD=1 ...), in each command.
PIP_REINSTALL = "{env}pip install --force-reinstall --no-deps --no-cache-dir cudelta"
UV_REINSTALL = "{env}uv pip install --reinstall-package cudelta --no-deps --no-cache cudelta"


def reinstall_commands(env: str = "") -> Tuple[str, str]:
    """(pip's command, uv's command), each runnable as is; `env`: 'FORCE_BUILD=1 ...' to run them under."""
    prefix = f"{env} " if env else ""
    return PIP_REINSTALL.format(env=prefix), UV_REINSTALL.format(env=prefix)


def reinstall(env: str = "") -> str:
    """The hint every message gives: pip's command, then uv's."""
    pip, uv = reinstall_commands(env)
    return f"{pip} (uv: {uv})"


REINSTALL = reinstall()
LEGACY_LABEL_KEY = "variant"

# Every key of schema 2 and the JSON type it must have.
FIELDS: Mapping[str, type] = {
    "schema": int,
    "version": str,
    "cuda_label": str,
    "cuda_toolkit": str,
    "archs": list,
    "ptx": list,
    "torch_built_with": str,
    "torch_floor": str,
    "python_floor": str,
    "driver_floor": str,
    "git_revision": str,
    "build": str,
    "fatbin_compression": bool,
}


class BuildRecordError(ValueError):
    """A build record that is not one: the message names the key."""


def parse(data: Any, required: Iterable[str] = tuple(FIELDS)) -> Dict[str, Any]:
    """A decoded record -> a schema-2 dict (a copy); BuildRecordError naming what is wrong.

    `required`: the keys this reader needs (the loader needs fewer than the release checks);
    every key that is present is type-checked either way. Unknown keys are kept.
    """
    if not isinstance(data, dict):
        raise BuildRecordError(f"the build record is {type(data).__name__}, not a JSON object")
    record = dict(data)
    schema = record.setdefault("schema", 1)
    if schema not in (1, SCHEMA):
        raise BuildRecordError(f"build record schema {schema!r}; this cudelta reads schemas 1 and {SCHEMA}")
    if schema == 1:
        if LEGACY_LABEL_KEY in record:
            record.setdefault("cuda_label", record[LEGACY_LABEL_KEY])
        record["schema"] = SCHEMA
    missing = [key for key in required if key not in record]
    if missing:
        raise BuildRecordError(f"the build record lacks {', '.join(missing)}")
    for key, kind in FIELDS.items():
        value = record.get(key)
        if key in record and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise BuildRecordError(f"build record {key} is {value!r}; expected a JSON {kind.__name__}")
    for key in ("archs", "ptx"):
        if not all(isinstance(item, str) for item in record.get(key, ())):
            raise BuildRecordError(f"build record {key} is {record[key]!r}; expected a list of strings")
    return record


def loads(text: str, required: Iterable[str] = tuple(FIELDS)) -> Dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BuildRecordError(f"the build record is not valid JSON ({exc})") from None
    return parse(data, required)


def read(path: Path, required: Iterable[str] = tuple(FIELDS)) -> Dict[str, Any]:
    """The record at `path`; OSError if unreadable, BuildRecordError if not a record."""
    return loads(Path(path).read_text(), required)


def dumps(record: Mapping[str, Any]) -> str:
    """The file's text (installer/compile/build_record.py writes it; the library embeds the same keys)."""
    return json.dumps(dict(record), indent=1, sort_keys=True) + "\n"
