"""What a vLLM release changed in the calls cudelta.vllm_compat mirrors and the benchmarks time.

    python benchmarks/vllm_surface.py 0.33.0 0.34.0 [--cache /tmp/vllm-wheel]
    python benchmarks/vllm_surface.py --wheels OLD.whl NEW.whl

Reads two vLLM wheels (downloaded as fetch_vllm_ops.py does, about 300 MB each, or given) and lists,
old against new:
- Python: each function or constant of SURFACE, by its signature and its code (ast.unparse, so
  that formatting alone is no change), with a diff of a changed body;
- the compiled ops library (vllm/_C_stable_libtorch.abi3.so): the op schemas and check messages
  that name the decode ops' arguments (as `strings` would print them), each decode kernel's
  instantiations (how many, and each template parameter's values), and the functions of the
  kernels' anonymous namespaces (a launch rule such as 0.34's choose_split_v), the last two from
  `nm -C` where binutils is installed.
What it prints is for a person to read: the drop-in and the benchmarks follow vLLM by hand.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fetch_vllm_ops import CUDA_OP_SO, download_wheel, wheel_version  # noqa: E402

GDN_LAYER = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
# (file, function or constant): what cudelta.vllm_compat takes the signatures and rules of, and the
# peers the benchmarks run.
SURFACE = (
    ("vllm/_custom_ops.py", "fused_gdn_decode_post_conv_mtp"),
    ("vllm/_custom_ops.py", "fused_kda_decode"),
    ("vllm/third_party/flash_linear_attention/ops/fused_recurrent.py", "fused_recurrent_gated_delta_rule_packed_decode"),
    ("vllm/third_party/flash_linear_attention/ops/fused_gdn_decode_post_conv_mtp.py",
     "fused_gdn_decode_post_conv_mtp_triton"),
    ("vllm/model_executor/layers/mamba/ops/causal_conv1d.py", "causal_conv1d_update"),
    ("vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py", "fused_recurrent_kda_packed_decode"),
    (GDN_LAYER, "MAX_FUSED_GDN_MTP_TOKENS"),
    (GDN_LAYER, "_can_use_fused_gdn_mtp_decode"),
    (GDN_LAYER, "_forward_core_decode_spec_post_conv_fused_norm"),
    ("vllm/models/kimi_k3/nvidia/kda.py", "is_fused_kda_decode_supported"),
)
# Library strings worth reading: the decode ops' names, arguments and check messages.
MESSAGE = re.compile(r"GDN|KDA|MTP|fused_kda|fused_gdn|\bstate_indices|mixed_qkv|num_accepted|conv_state|output_gate")
KERNEL = re.compile(r"\b(\w+_kernel)<([^<>()]*)>")
KERNEL_WORDS = ("gdn_decode", "kda_decode")
HELPER = re.compile(r"\(anonymous namespace\)::(\w+)(?:<[^()]*>)?\(")
HELPER_WORDS = re.compile(r"gdn|kda|mtp|split|choose", re.IGNORECASE)


def definitions(source: str) -> dict[str, tuple[str, str]]:
    """Each function (methods included) and module-level constant of a module's source -> (its
    signature, its code), both as ast.unparse writes them."""
    tree = ast.parse(source)
    found: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            found.setdefault(node.name, (f"({ast.unparse(node.args)}){returns}", ast.unparse(node)))
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, (f"= {ast.unparse(node.value)}", ast.unparse(node)))
    return found


def python_changes(old: dict[str, str], new: dict[str, str], context: int = 40) -> list[str]:
    """old, new: SURFACE's files (path -> source, absent when the wheel lacks it) -> a line a
    change, a changed body followed by its diff (at most `context` lines)."""
    lines = []
    parsed = {}
    for path, name in SURFACE:
        for side, files in (("old", old), ("new", new)):
            if (side, path) not in parsed:
                parsed[side, path] = definitions(files[path]) if path in files else None
        before, after = parsed["old", path], parsed["new", path]
        where = f"{path}: {name}"
        if before is None or after is None:
            if before is not after:
                lines.append(f"- {where}: the file is {'gone' if after is None else 'new'}")
            continue
        if name not in before or name not in after:
            if name in before or name in after:
                lines.append(f"- {where}: {'gone' if name not in after else 'new'}")
            continue
        (sig_old, code_old), (sig_new, code_new) = before[name], after[name]
        if sig_old.startswith("= "):  # a constant: its value is the whole change
            if sig_old != sig_new:
                lines.append(f"- {where}: {sig_old[2:]} -> {sig_new[2:]}")
            continue
        if sig_old != sig_new:
            lines.append(f"- {where}: signature {sig_old} -> {sig_new}")
        elif code_old != code_new:
            lines.append(f"- {where}: body changed")
        if code_old != code_new:
            diff = list(difflib.unified_diff(code_old.splitlines(), code_new.splitlines(), lineterm="", n=1))[2:]
            lines += ["      " + d for d in diff[:context]]
            if len(diff) > context:
                lines.append(f"      ... {len(diff) - context} more diff lines")
    return lines


def printable_strings(data: bytes, shortest: int = 8) -> list[str]:
    """What `strings` prints: runs of printable ASCII of at least `shortest` characters."""
    return [m.decode() for m in re.findall(rb"[\x20-\x7e]{%d,}" % shortest, data)]


def library_facts(strings: list[str], symbols: list[str] | None) -> dict[str, set[str] | None]:
    """The library's decode-op messages (from its strings), and where `symbols` (`nm -C` lines) are
    given, its decode kernels' instantiations ("name<args>") and its anonymous-namespace helpers
    whose names speak of the decode ops."""
    messages = {s.strip() for s in strings
                if MESSAGE.search(s) and not s.startswith(("_Z", "_GLOBAL__")) and "tmpxft" not in s}
    if symbols is None:
        return {"messages": messages, "kernels": None, "helpers": None}
    kernels, helpers = set(), set()
    for line in symbols:
        if "_kernel<" in line:
            kernels |= {f"{name}<{args}>" for name, args in KERNEL.findall(line)
                        if any(word in name for word in KERNEL_WORDS)}
        if "(anonymous namespace)::" in line:
            helpers |= {name for name in HELPER.findall(line)
                        if HELPER_WORDS.search(name) and not name.endswith("_kernel")}
    return {"messages": messages, "kernels": kernels, "helpers": helpers}


def instantiations(kernels: set[str]) -> dict[str, str]:
    """"name<a, b>" instantiations -> for each kernel, its count and each template parameter's
    values: {"k": "4 x <float|bf16, 1|2>"}."""
    params: dict[str, list[list[str]]] = {}
    for kernel in kernels:
        name, args = kernel[:-1].split("<", 1)
        params.setdefault(name, []).append([a.strip() for a in args.split(",")])
    summary = {}
    for name, rows in params.items():
        columns = [sorted({row[i] for row in rows if i < len(row)}) for i in range(max(map(len, rows)))]
        summary[name] = f"{len(rows)} x <{', '.join('|'.join(values) for values in columns)}>"
    return summary


def library_changes(old: dict, new: dict) -> list[str]:
    lines = [f"- library string gone: {s}" for s in sorted(old["messages"] - new["messages"])]
    lines += [f"- library string new: {s}" for s in sorted(new["messages"] - old["messages"])]
    if old["kernels"] is None or new["kernels"] is None:
        return lines + ["- kernels and helper functions: not compared (no `nm` on PATH)"]
    before, after = instantiations(old["kernels"]), instantiations(new["kernels"])
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) != after.get(name):
            lines.append(f"- kernel {name}: {before.get(name, 'none')} -> {after.get(name, 'none')}")
    lines += [f"- function gone: {s}" for s in sorted(old["helpers"] - new["helpers"])]
    lines += [f"- function new: {s}" for s in sorted(new["helpers"] - old["helpers"])]
    return lines


def read_wheel(wheel: Path, work: Path) -> tuple[dict[str, str], dict]:
    """A wheel's SURFACE files (path -> source) and its library's facts."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        files = {path: zf.read(path).decode() for path in {p for p, _ in SURFACE} if path in names}
        if CUDA_OP_SO not in names:
            return files, {"messages": set(), "kernels": set(), "helpers": set()}
        library = work / f"{wheel.stem}.so"
        library.write_bytes(zf.read(CUDA_OP_SO))
    nm = shutil.which("nm")
    symbols = subprocess.run([nm, "-C", str(library)], capture_output=True, text=True, check=True).stdout.splitlines() \
        if nm else None
    facts = library_facts(printable_strings(library.read_bytes()), symbols)
    library.unlink()
    return files, facts


def report(old_wheel: Path, new_wheel: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="vllm-surface-") as tmp:
        old_files, old_lib = read_wheel(old_wheel, Path(tmp))
        new_files, new_lib = read_wheel(new_wheel, Path(tmp))
    old_v, new_v = wheel_version(old_wheel), wheel_version(new_wheel)
    python = python_changes(old_files, new_files) or ["- no change"]
    library = library_changes(old_lib, new_lib) or ["- no change"]
    return "\n".join([f"vLLM {old_v} -> {new_v}: what cudelta.vllm_compat mirrors and the benchmarks run", "",
                      "Python (signatures, code):", *python, "", f"{CUDA_OP_SO}:", *library])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", metavar="VERSION", help="two vLLM versions, old then new")
    parser.add_argument("--wheels", nargs=2, type=Path, metavar="WHEEL", help="two vLLM wheels instead, old then new")
    parser.add_argument("--cache", type=Path, help="folder for the downloaded wheels (kept; a wheel there is reused)")
    args = parser.parse_args(argv)
    if bool(args.wheels) == bool(args.versions) or (args.versions and len(args.versions) != 2):
        parser.error("give two versions (old new) or --wheels OLD NEW")
    with tempfile.TemporaryDirectory(prefix="vllm-wheels-") as tmp:
        wheels = args.wheels or [download_wheel(v, args.cache or Path(tmp)) for v in args.versions]
        print(report(*wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
