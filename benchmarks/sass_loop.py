"""What a kernel's loops issue, read from its machine code: no GPU needed.

ncu (ncu_mtp.py --source) says where warps wait, but only on a GPU. The instructions a token loop
issues, and which of them sit on its chain (shuffles, shared loads), can be read from the SASS on
any machine: this finds each loop of a kernel (a backward branch and the instructions it jumps
over) and counts its instructions by opcode. It reads cudelta's build and vLLM's library alike
(`cuobjdump -sass`), so the two token loops can be put side by side:

    python benchmarks/sass_loop.py cudelta/_C.abi3.so --arch sm_90a --kernel 'decode_mtp_stream_kernelILb1ELi128E13__nv_bfloat16Lb0ELb0ELi8E'
    python benchmarks/sass_loop.py vllm/_C_stable_libtorch.abi3.so --arch sm_90a --kernel 'gdn_decode_post_conv_mtp_kernelI13__nv_bfloat16Li2ELb1ELi4E'

(cudelta's: an installed or built extension, or one unit compiled to a cubin with the shipped flags.
Dumping a whole library takes minutes: --arch keeps it to one architecture's code.)

cuobjdump: CUOBJDUMP names one, else release/check_wheel.py's search (the PyPI package
`nvidia-cuda-cuobjdump`, PATH, the CUDA toolkit). --sass reads text already dumped.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from release.wheel_parsers import find_cuobjdump  # noqa: E402  (the one release/check_wheel.py uses)

FUNCTION = re.compile(r"Function : (\S+)")
# "/*5570*/   @!P0 BRA 0x6370 ;": address, optional predicate, opcode with modifiers, operands.
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")
# Opcode families the table gives a column each (the first word of the opcode, before any '.').
COLUMNS = ("FFMA", "FMUL", "FADD", "SHFL", "LDS", "STS", "LDG", "STG", "F2FP", "BAR")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with modifiers: SHFL.BFLY, STG.E.EF.128
    operands: str

    @property
    def family(self) -> str:
        return self.opcode.split(".")[0]


@dataclass(frozen=True)
class Loop:
    """The instructions from a backward branch's target up to and including the branch."""

    start: int
    end: int
    instructions: tuple[Instruction, ...]

    def mix(self) -> Counter:
        return Counter(i.family for i in self.instructions)


def functions(sass: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass text -> mangled function name -> its instructions in address order."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in sass.splitlines():
        if m := FUNCTION.search(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := INSTRUCTION.search(line)):
            current.append(Instruction(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out


def loops(instructions: list[Instruction]) -> list[Loop]:
    """Every backward branch's loop, smallest first (an inner loop before the loop around it)."""
    found = []
    for i, ins in enumerate(instructions):
        if ins.family != "BRA" or not (m := BRANCH_TARGET.search(ins.operands)):
            continue
        target = int(m.group(1), 16)
        if target > ins.address:
            continue
        body = tuple(x for x in instructions[: i + 1] if x.address >= target)
        found.append(Loop(target, ins.address, body))
    return sorted(found, key=lambda loop: (len(loop.instructions), loop.start))


def pick(names: list[str], pattern: str) -> str:
    """The one function whose mangled name contains `pattern`; an error names the candidates."""
    hits = [name for name in names if pattern in name]
    if len(hits) != 1:
        shown = "\n  ".join(hits[:20] or names[:20])
        what = "no function matches" if not hits else f"{len(hits)} functions match"
        raise SystemExit(f"sass_loop: {what} {pattern!r}; {'the first functions' if not hits else 'they are'}:\n  {shown}")
    return hits[0]


def holding(found: list[Loop], families: list[str]) -> list[Loop]:
    """The loops that hold an instruction of every family named."""
    return [loop for loop in found if all(loop.mix()[f] for f in families)]


def table(name: str, chosen: list[Loop], limit: int) -> str:
    rows = [f"{name}", "", "| loop | instructions | " + " | ".join(COLUMNS) + " | other |",
            "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for loop in chosen[:limit]:
        mix = loop.mix()
        other = len(loop.instructions) - sum(mix[c] for c in COLUMNS)
        rows.append(f"| 0x{loop.start:x}-0x{loop.end:x} | {len(loop.instructions)} | "
                    + " | ".join(str(mix[c]) for c in COLUMNS) + f" | {other} |")
    if not chosen:
        rows.append("| (no such loop) |")
    return "\n".join(rows)


def dump(binary: Path, arch: str | None) -> str:
    tool = find_cuobjdump(os.environ.get("CUOBJDUMP"))
    if tool is None:
        raise SystemExit("sass_loop: no cuobjdump: `pip install nvidia-cuda-cuobjdump`, put the CUDA toolkit's "
                         "on PATH, or name one with CUOBJDUMP=")
    command = [tool, "-sass", *(["-arch", arch] if arch else []), str(binary)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"sass_loop: {' '.join(command)} failed: {run.stderr.strip()}")
    return run.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", nargs="?", type=Path, help="a cubin, an object or a shared library")
    parser.add_argument("--sass", type=Path, help="read cuobjdump -sass output from this file instead")
    parser.add_argument("--arch", help="cuobjdump -arch (e.g. sm_90a): only that architecture's code")
    parser.add_argument("--kernel", required=True, help="a substring of the kernel's mangled name")
    parser.add_argument("--holding", nargs="*", default=["SHFL", "STG"], help="only loops holding each of these "
                        "opcode families (default SHFL STG: a token loop reduces over K and stores the token's "
                        "state); none for every loop")
    parser.add_argument("--limit", type=int, default=4, help="loops shown, smallest first")
    args = parser.parse_args(argv)
    if (args.binary is None) == (args.sass is None):
        parser.error("give a binary or --sass, one of them")
    text = args.sass.read_text() if args.sass else dump(args.binary, args.arch)
    by_name = functions(text)
    name = pick(sorted(by_name), args.kernel)
    print(table(name, holding(loops(by_name[name]), args.holding), args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
