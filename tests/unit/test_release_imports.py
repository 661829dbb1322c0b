"""release/ keeps no shims: every name taken from a release module is one that module defines.

A re-export works without a `noqa` (test_installer_layers.py finds those): check_wheel.py importing
`cuda` from wheel_parsers, then a caller reading `check_wheel.cuda`, runs fine and hides where
`cuda` lives. So every import of a release module in release/, tests/ and benchmarks/ is read with
`ast`: `from release.m import x`, `from .m import x`, `from .m import *`, and `m.x` where `m` names a
release module. Each `x` must be a def, a class or an assignment at m's top level (an import there
does not count), or a module of the package. The rule also runs on a made-up tree that breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "release"
IMPORTERS = ("release", "tests", "benchmarks")


def module_file(root: Path, dotted: str) -> Optional[Path]:
    """'release.check_wheel' -> root/release/check_wheel.py (or a package's __init__.py); None if neither."""
    path = root.joinpath(*dotted.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def top_level(statements: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's own statements, those under a top-level if / try / with included."""
    for node in statements:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                yield from top_level(getattr(node, block, []))
        for handler in getattr(node, "handlers", []):
            yield from top_level(handler.body)


def defined_names(path: Path) -> Set[str]:
    """The names `path` defines itself: defs, classes and assignments, not what it imports."""
    names: Set[str] = set()
    for node in top_level(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def imported_module(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The dotted module an ImportFrom reads, relative ones resolved against `path`'s package."""
    if not node.level:
        return node.module or ""
    package = path.relative_to(root).parent.parts
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ((node.module,) if node.module else ()))


def names_not_where_they_live(root: Path) -> List[str]:
    """'file:line x from m' for every name taken from release module m that m does not define."""
    found: List[str] = []
    for folder in IMPORTERS:
        for path in sorted((root / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue  # .peers/ and the like: extracted at run time, not ours
            found += _check_file(path, root)
    return found


def _check_file(path: Path, root: Path) -> List[str]:
    where = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    bound: Dict[str, str] = {}  # a local name -> the release module it names
    found: List[str] = []

    def take(line: int, module: str, name: str, alias: Optional[str]) -> None:
        if name == "*":
            found.append(f"{where}:{line} * from {module}")
        elif module_file(root, f"{module}.{name}"):
            bound[alias or name] = f"{module}.{name}"
        elif name not in defined_names(module_file(root, module)):
            found.append(f"{where}:{line} {name} from {module}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = imported_module(node, path, root)
            if module.split(".")[0] == PACKAGE and module_file(root, module):
                for alias in node.names:
                    take(node.lineno, module, alias.name, alias.asname)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.split(".")[0] == PACKAGE and module_file(root, alias.name):
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name) and node.value.id in bound):
            module = bound[node.value.id]
            if node.attr not in defined_names(module_file(root, module)) and not module_file(root, f"{module}.{node.attr}"):
                found.append(f"{where}:{node.lineno} {node.attr} from {module}")
    return sorted(set(found), key=lambda line: (line.split(":")[0], int(line.split(":")[1].split()[0]), line))


def test_every_name_is_imported_from_the_release_module_that_defines_it():
    assert names_not_where_they_live(ROOT) == []


def test_names_taken_through_a_shim_are_found(tmp_path):
    files = {
        "release/__init__.py": "",
        "release/parsers.py": "import json\nfrom x import y\nPASS = 'PASS'\n\ndef parse(t):\n    return t\n",
        "release/check.py": "from . import parsers\nfrom .parsers import json, parse\nfrom .parsers import *\n"
                            "from release.parsers import PASS, y\n",
        "release/run.py": "from . import check\nfrom .parsers import PASS\nok = check.parse(PASS)\ncheck.json = 1\n",
        "tests/test_check.py": "import release.parsers as p\nfrom release import check as c\n"
                               "def test():\n    c.PASS, p.parse, p.json\n",
        "benchmarks/bench.py": "from release.check import parsers\n",  # a name check.py imports: a shim too
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert names_not_where_they_live(tmp_path) == [
        "release/check.py:2 json from release.parsers",
        "release/check.py:3 * from release.parsers",
        "release/check.py:4 y from release.parsers",
        "release/run.py:3 parse from release.check",
        "tests/test_check.py:4 PASS from release.check",
        "tests/test_check.py:4 json from release.parsers",
        "benchmarks/bench.py:1 parsers from release.check",
    ]
