"""`python -m cudelta`: what is installed, what the machine has, what runs on each GPU, and a
smoke test of every kernel variant against the PyTorch reference. `--json` for machines."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Optional

import torch

from . import _build_record, _native
from ._call import DecodeCall
from .ops import run_kernel
from .reference import gdn_decode_reference


def driver_cuda_version() -> Optional[str]:
    """The CUDA version the driver supports, e.g. '13.0' (the same reading the loader's guard uses)."""
    seen = _native.driver_cuda_version()
    return f"{seen[0]}.{seen[1]}" if seen else None


_HOW = {
    "prebuilt": "prebuilt release asset, fetched and verified by the sdist's installer",
    "pure": "pure-Python wheel (PyTorch reference ops)",
    "local": "compiled on this machine",
}


def install_source() -> dict:
    """What was installed and why, from the install record (cudelta/_install_record.py)."""
    try:
        dist = metadata.distribution("cudelta")
    except metadata.PackageNotFoundError:
        return {"installed": False}
    record = _native.read_install_record()
    build = (_native.read_build_info() or {}).get("build")
    if record and record.get("kind") in _HOW:
        how = _HOW[record["kind"]]
    elif record:  # schema 1: only a prebuilt wrote one
        how = _HOW["prebuilt"]
    elif build == "release":
        how = "release wheel installed directly (URL, --find-links or index)"
    elif build == "local":
        how = "compiled on this machine"
    else:
        how = "pure-Python wheel (PyTorch reference ops)"
    return {"installed": True, "version": dist.version, "from": how, "record": record}


def render_choice(record: dict, check: Optional[str]) -> list:
    """Why this install: the facts it was chosen from, the verdict, the assets not taken, and
    whether this machine would choose the same."""
    m = record["machine"]
    facts = (f"{m['os']} {m['arch']}" + (f" glibc {m['glibc']}" if m["glibc"] else "") + f", Python {m['python']}, "
             + (f"driver CUDA {m['driver_cuda']}" if m["driver_cuda"] else "no NVIDIA driver") + ", "
             + (f"GPUs {', '.join(m['gpus'])}" if m["gpus"] else "no GPU") + ", "
             + (f"torch {m['torch']}" if m["torch"] else "torch not seen")
             + (f", {m['override']}" if m["override"] else ""))
    lines = [f"  chosen from  {facts}", f"  verdict      {record['reason']}"]
    for name, why in record.get("rejected", []):
        lines.append(f"  not chosen   {name}: {why}")
    lines.append(f"  this machine {check or 'would choose the same'}")
    return lines


def smoke_inputs(device: str, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    N, H, HV, K, V, P = 6, 2, 4, 128, 128, 9

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    q = rnd(N, H, K).to(torch.bfloat16)
    k = rnd(N, H, K).to(torch.bfloat16)
    v = rnd(N, HV, V).to(torch.bfloat16)
    g = -torch.rand(N, HV, generator=gen).to(device)
    beta = torch.rand(N, HV, generator=gen).to(device)
    state = rnd(P, HV, K, V, scale=0.1)
    idx = torch.tensor([3, -1, 0, 7, 5, 1], dtype=torch.int32, device=device)
    return q, k, v, g, beta, state, idx


def smoke_test(device: str, variant: int) -> dict:
    q, k, v, g, beta, state, idx = smoke_inputs(device)
    ref_state = state.clone()
    ref_out = gdn_decode_reference(q, k, v, g, beta, ref_state, idx, use_qk_l2norm=True)
    out = torch.empty_like(v)
    run_kernel(DecodeCall("gdn", q, k, v, g, beta, state, idx, use_qk_l2norm=True), out, variant)
    torch.cuda.synchronize(device)
    scale = float(ref_state.abs().max())
    state_err = float((state - ref_state).abs().max()) / scale
    out_err = float((out.float() - ref_out.float()).abs().max()) / max(float(ref_out.float().abs().max()), 1e-6)
    ok = state_err <= 1e-4 and out_err <= 1e-2  # output is bf16: 8 mantissa bits
    return {"state_rel_err": state_err, "out_rel_err": out_err, "ok": ok}


def gpu_report(index: int, run_smoke: bool) -> dict:
    props = torch.cuda.get_device_properties(index)
    entry = {"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}"}
    st = _native.status()
    if not st.loaded:
        entry["image"] = None
        return entry
    cc, arch, arch_specific, family, chosen = torch.ops.cudelta.probe(index)
    if arch == 0:
        built = ", ".join((st.build_info or {}).get("archs", []) + (st.build_info or {}).get("ptx", []))
        entry["image"] = None
        entry["error"] = (f"no kernel image for compute {props.major}.{props.minor} (built for {built}); fix: "
                          f"{_build_record.reinstall(f'FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST={props.major}.{props.minor}')}")
        return entry
    entry["image"] = {"cuda_arch": arch, "arch_specific": bool(arch_specific), "family_specific": bool(family)}
    names = {vid: name for name, vid in st.variants.items()}
    entry["variant_auto"] = names[chosen]
    entry["variant_in_use"] = names[chosen if st.variant < 0 else st.variant]
    if run_smoke:
        smoke = {}
        for name, vid in st.variants.items():
            try:
                torch.ops.cudelta.select_variant(index, vid, 1 << 30)
            except RuntimeError as exc:
                smoke[name] = {"ok": None, "skipped": str(exc).splitlines()[0]}
                continue
            smoke[name] = smoke_test(f"cuda:{index}", vid)
        entry["smoke"] = smoke
    return entry


def report(run_smoke: bool = True) -> dict:
    st = _native.status()
    out = {
        "cudelta": install_source(),
        "build_info": st.build_info,
        "native": {"library": str(st.path) if st.path else None, "loaded": st.loaded, "reason": st.reason},
        "install_check": st.install_check,
        "torch": {"version": str(torch.__version__), "cuda": torch.version.cuda,
                  "cuda_available": torch.cuda.is_available()},
        "gpus": [],
    }
    if st.loaded:
        out["library_build_info"] = json.loads(torch.ops.cudelta.build_info())
    out["driver_cuda"] = driver_cuda_version()
    if torch.cuda.is_available():
        out["gpus"] = [gpu_report(i, run_smoke) for i in range(torch.cuda.device_count())]
    return out


def render(r: dict) -> str:
    lines = []
    c = r["cudelta"]
    lines.append(f"cudelta {c.get('version', '(not installed: source tree)')}: {c.get('from', '')}")
    record = c.get("record") or {}
    if record.get("asset"):
        lines.append(f"  asset   {record['asset']}  sha256 {record['sha256'][:16]}…")
    if record.get("schema") == 2:
        lines.extend(render_choice(record, r.get("install_check")))
    b = r["build_info"]
    if b:
        lines.append(f"  build   {b['build']} {b['cuda_label']}: CUDA {b['cuda_toolkit']}, cubins {', '.join(b['archs'])}"
                     f", PTX {', '.join(b['ptx']) or 'none'}; torch {b['torch_built_with']} (floor {b['torch_floor']})"
                     f", git {b['git_revision']}")
    n = r["native"]
    lines.append(f"  native  {'loaded' if n['loaded'] else 'not loaded'}: {n['library'] or '-'}"
                 + ("" if n["loaded"] else f" ({n['reason']})"))
    t = r["torch"]
    lines.append(f"torch {t['version']} (CUDA {t['cuda']}), driver CUDA {r.get('driver_cuda') or '-'}, "
                 f"{len(r['gpus'])} GPU(s)")
    for gpu in r["gpus"]:
        head = f"  GPU {gpu['index']}: {gpu['name']} (compute {gpu['capability']})"
        if gpu.get("image"):
            img = gpu["image"]
            kind = " arch-specific" if img["arch_specific"] else (" family" if img["family_specific"] else "")
            head += (f": image sm_{img['cuda_arch'] // 10}{kind}, variant {gpu['variant_in_use']}"
                     f" (auto: {gpu['variant_auto']})")
        elif gpu.get("error"):
            head += f": {gpu['error']}"
        lines.append(head)
        for name, res in gpu.get("smoke", {}).items():
            if res["ok"] is None:
                lines.append(f"    smoke {name:8s} skipped: {res['skipped']}")
            else:
                lines.append(f"    smoke {name:8s} {'PASS' if res['ok'] else 'FAIL'}  state rel err "
                             f"{res['state_rel_err']:.2e}  output rel err {res['out_rel_err']:.2e}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudelta", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-smoke", action="store_true", help="skip the kernel smoke tests")
    args = parser.parse_args(argv)
    r = report(run_smoke=not args.no_smoke)
    print(json.dumps(r, indent=1) if args.json else render(r))
    failed = any(res.get("ok") is False for gpu in r["gpus"] for res in gpu.get("smoke", {}).values())
    errored = any(gpu.get("error") for gpu in r["gpus"])
    return 1 if failed or errored else 0


if __name__ == "__main__":
    sys.exit(main())
