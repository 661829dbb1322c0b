"""installer/ in wings: every import runs down the declared layers; and neither installer/ nor
release/ re-exports a name (`noqa: F401` / `F403`).

A module may import its own wing and any wing of a lower layer; wings of one layer never import
each other, and no wing imports the top (commands.py, dead_end.py). Imports are read with `ast`,
the ones inside functions included. Each rule also runs on a made-up tree that breaks it, so it
cannot pass vacuously. (release/'s re-exports without a `noqa`: test_release_imports.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

INSTALLER = Path(__file__).resolve().parents[2] / "installer"
RELEASE = INSTALLER.parent / "release"
TOP = ""  # the modules directly in installer/
# Lowest first; ARCHITECTURE.md walks the same tree.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("core",),             # errors, log, settings, target, cuda, shipped, wheel_version
    ("detect", "choose"),  # what the target is; what to install (manifest, choice, plan, its record)
    ("fetch", "compile"),  # a verified prebuilt wheel; a local compile (not build/: ignored as output)
    (TOP,),                # the setuptools commands and the dead end's last line
)
RANK: Dict[str, int] = {wing: rank for rank, wings in enumerate(LAYERS) for wing in wings}


def wing_of(parts: Tuple[str, ...], root: Path) -> str:
    """('installer', 'fetch', 'cache') -> 'fetch'; ('installer', 'commands') -> TOP."""
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (root / parts[1]).is_dir()) else TOP


def module_parts(path: Path, root: Path) -> Tuple[str, ...]:
    rel = path.relative_to(root.parent).with_suffix("")
    return rel.parts[:-1] if rel.name == "__init__" else rel.parts


def imported_modules(path: Path, root: Path) -> Iterator[Tuple[int, Tuple[str, ...]]]:
    """(line, module parts) of every installer module that `path` imports."""
    here = module_parts(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root.name:
                    yield node.lineno, tuple(alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = base + tuple(node.module.split(".") if node.module else ())
            elif node.module and node.module.split(".")[0] == root.name:
                target = tuple(node.module.split("."))
            else:
                continue
            folder = root.parent.joinpath(*target)
            if folder.is_dir():  # `from .core import cuda`: the names are modules of that package
                for alias in node.names:
                    yield node.lineno, target + (alias.name,)
            else:
                yield node.lineno, target


def against_the_grain(root: Path) -> List[str]:
    """Every import from one wing into a wing it may not use, and every module of an undeclared wing."""
    found = []
    for path in sorted(root.rglob("*.py")):
        here = wing_of(module_parts(path, root), root)
        where = path.relative_to(root.parent).as_posix()
        if here not in RANK:
            found.append(f"{where}: wing {here!r} is in no layer of LAYERS")
            continue
        for line, target in imported_modules(path, root):
            there = wing_of(target, root)
            if there == here:
                continue
            if there not in RANK or RANK[there] >= RANK[here]:
                found.append(f"{where}:{line} imports {'.'.join(target)}: {here or 'the top'} "
                             f"(layer {RANK[here]}) may not import {there or 'the top'} (layer {RANK.get(there)})")
    return found


# An import silenced as unused (F401) or a star import silenced (F403), alone or in a list (`E402,F401`).
RE_EXPORT_NOQA = re.compile(r"noqa:[^#]*\bF40[13]\b")


def re_exports(root: Path) -> List[str]:
    """Imports kept only so that others can import a name from here (`noqa: F401` / `F403`)."""
    return [f"{path.relative_to(root.parent).as_posix()}:{number}"
            for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if RE_EXPORT_NOQA.search(line)]


def made_up_tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    root = tmp_path / "installer"
    for wing in ("core", "detect", "choose", "fetch", "compile"):
        (root / wing).mkdir(parents=True)
        (root / wing / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_every_import_in_installer_runs_down_the_layers():
    assert against_the_grain(INSTALLER) == []


def test_every_wing_is_a_package_of_a_layer():
    wings = {p.parent.name for p in INSTALLER.glob("*/*.py")}
    assert wings == set(RANK) - {TOP}
    assert [wing for wing in sorted(wings) if not (INSTALLER / wing / "__init__.py").is_file()] == []


def test_installer_re_exports_nothing():
    assert re_exports(INSTALLER) == []


def test_release_re_exports_nothing():
    assert re_exports(RELEASE) == []


def test_downward_imports_pass_in_every_spelling(tmp_path):
    root = made_up_tree(tmp_path, {
        "core/cuda.py": "from . import errors\n",
        "core/errors.py": "",
        "detect/driver.py": "from ..core import cuda\nfrom ..core.errors import X\n",
        "compile/native.py": "from ..detect.driver import probe\nfrom ..choose import plan\nfrom . import glibc\n",
        "fetch/cache.py": "import installer.core.errors\nfrom installer.choose import plan\n",
        "commands.py": "from .compile import native\nfrom .fetch.cache import y\nfrom . import dead_end\n",
        "dead_end.py": "from .core.errors import X\n",
    })
    assert against_the_grain(root) == []


def test_imports_against_the_grain_are_found(tmp_path):
    root = made_up_tree(tmp_path, {
        "core/cuda.py": "def f():\n    from ..detect import driver\n",  # upward, inside a function
        "detect/driver.py": "from ..choose.plan import x\n",  # a sibling of the same layer
        "fetch/cache.py": "from installer.compile import native\n",  # a sibling, imported absolutely
        "compile/native.py": "from .. import commands\n",  # the top
        "choose/plan.py": "from ..dead_end import final_line\n",  # the top, by module
        "commands.py": "from .compile import native\n",  # the top may import anything
        "extra/thing.py": "",  # a wing in no layer
    })
    assert [line.split(":")[0] for line in against_the_grain(root)] == [
        "installer/choose/plan.py", "installer/compile/native.py", "installer/core/cuda.py",
        "installer/detect/driver.py", "installer/extra/thing.py", "installer/fetch/cache.py"]


def test_a_noqa_re_export_is_found_in_every_spelling(tmp_path):
    root = made_up_tree(tmp_path, {
        "fetch/fetch.py": "from .cache import LOCK  # noqa: F401\n",
        "fetch/urls.py": "import os\nfrom .cache import *  # noqa: F401,F403  (re-exported)\n",
        "compile/native.py": "import sys\nsys.path.insert(0, '.')\nfrom x import y  # noqa: E402, F401\n",
        "detect/driver.py": "import ctypes  # noqa: E402  (after the probe)\n",  # silenced, but used
    })
    assert re_exports(root) == ["installer/compile/native.py:3", "installer/fetch/fetch.py:1", "installer/fetch/urls.py:2"]
