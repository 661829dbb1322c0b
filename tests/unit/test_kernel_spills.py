"""The kernels vLLM's calls run keep their work in registers. They sit at the 128-register cap of
their launch bound, where one small source change made ptxas spill 256 bytes a thread in the step
and the kernel 30% slower (benchmarks/results-h200-mtp.md): ptxas's own count, with the shipped
nvcc flags, catches that before a GPU does. For sm_90a (the GPUs the benchmarks measure), sm_80
(the release's cubin for 8.x GPUs, where the streaming kernel spilled 48-152 bytes a thread until
its reload addresses were kept out of registers; no such GPU here to time it on), and the bf16
builds of sm_100 and sm_120. And the staged one-token step kernel's shared memory, which the split every
conv asks the driver for is sized to."""

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from nvcc_unit import compile_unit

from installer.core import shipped

ROOT = shipped.SOURCE_ROOT
# The streaming multi-token kernel in layout vk at K = 128 for GDN (vLLM's MTP call), the few-token
# kernel (the call with one draft token, and with up to three an fp32 state's and vLLM's bf16 call
# on sm_90, in small grids) and the one-token kernels (vLLM's call at T = 1).
PINNED = re.compile(r"decode_mtp_stream_kernelILb1ELi128E(13__nv_bfloat16|f)Lb0E"
                    r"|decode_vk_(one|one_warp|one_staged|few)_kernelILi128E")


def ptxas_report(unit: str, arch: str, out_dir) -> tuple[dict[str, int], dict[str, int]]:
    """Kernel (mangled name) -> bytes of spill stores, and -> bytes of static shared memory, as
    `ptxas -v` reports them for one unit."""
    spills, smem, name = {}, {}, None
    for line in compile_unit(unit, arch, out_dir / "unit.cubin", "-Xptxas", "-v", "-cubin").splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = m.group(1)
        elif (m := re.search(r"(\d+) bytes spill stores", line)) and name:
            spills[name] = int(m.group(1))
        elif (m := re.search(r"Used \d+ registers.*?(\d+) bytes smem", line)) and name:
            smem[name], name = int(m.group(1)), None
    return spills, smem


# sm_100 and sm_120 for bf16 state only (vLLM's default): their fp32 streaming build holds a few
# values across the staging barrier in 16-24 bytes of stack, reloaded once a pass (ARCHITECTURE.md).
BUILDS = [(arch, unit) for arch in ("9.0a", "8.0") for unit in ("mtp_bfloat16.cu", "mtp_float32.cu")] + [
    (arch, "mtp_bfloat16.cu") for arch in ("10.0f", "12.0f")]


# The allowances: the streaming kernel's staging-first build (kStreamStageFirstBuild) at sm_90a
# holds two values across the whole kernel in 8 bytes of stack, stored once at its start and
# reloaded once after the token loop (its SASS): a cost a block, not a token. More, or a spill
# anywhere else, still fails.
STAGE_FIRST_BUILD = "decode_mtp_stream_kernelILb1ELi128E13__nv_bfloat16Lb0ELb1E"
# And the conv's fp32 width-4 build for calls of at most 2 tokens at sm_90a, held to 64 registers:
# one 32-bit value loaded at its start, stored to 4 bytes of stack once a thread before the request
# loop and reloaded from L1 once a token batch (its SASS). fp32 conv state is not vLLM's (its conv
# state is the model's bf16, whose builds spill nothing and were timed: results-h200-conv.md).
CONV_SHORT_FP32_W4 = "conv_update_kernelILi4EfLi2EE"
ALLOWED = {("9.0a", STAGE_FIRST_BUILD): 8, ("9.0a", CONV_SHORT_FP32_W4): 4}


def allowed_bytes(arch: str, name: str) -> int:
    return max((n for (a, part), n in ALLOWED.items() if a == arch and part in name), default=0)


@pytest.fixture(scope="module")
def ptxas(request, tmp_path_factory):
    """(unit, arch) -> ptxas's report, for every build this run's selected tests read, compiled side by
    side: each is one ptxas on one core (on CI's 2 cores, 1.6 minutes; one after another, 4)."""
    wanted = sorted({(item.callspec.params["unit"], item.callspec.params["arch"])
                     for item in request.session.items
                     if {"spill_stores", "shared_memory"} & set(getattr(item, "fixturenames", ()))})
    with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), os.cpu_count() or 1))) as pool:
        futures = {(unit, arch): pool.submit(ptxas_report, unit, arch, tmp_path_factory.mktemp("ptxas"))
                   for unit, arch in wanted}
    # A missing nvcc skips, a failed compile fails: in the test that reads that build, as it raised.
    return lambda unit, arch: futures[unit, arch].result()


@pytest.fixture(scope="module")
def spill_stores(ptxas):
    """(unit, arch) -> kernel -> bytes of spill stores."""
    return lambda unit, arch: ptxas(unit, arch)[0]


@pytest.fixture(scope="module")
def shared_memory(ptxas):
    """(unit, arch) -> kernel -> bytes of static shared memory."""
    return lambda unit, arch: ptxas(unit, arch)[1]


@pytest.mark.parametrize("arch, unit", BUILDS)
def test_the_kernels_vllms_calls_run_spill_nothing(unit, arch, spill_stores):
    spills = spill_stores(unit, arch)
    pinned = {name: n for name, n in spills.items() if PINNED.search(name)}
    # The streaming kernel (both builds where there are two), the one-token block and warp kernels
    # and the few-token kernel were all found.
    assert any("stream" in name for name in pinned) and any("one_kernel" in name for name in pinned)
    assert any("one_warp_kernel" in name for name in pinned) and any("few_kernel" in name for name in pinned)
    if unit == "mtp_bfloat16.cu":
        assert any(STAGE_FIRST_BUILD in name for name in pinned)
    assert {name: n for name, n in pinned.items() if n > allowed_bytes(arch, name)} == {}


@pytest.mark.parametrize("arch, unit", [("9.0a", "conv.cu"), ("8.0", "conv.cu")])
def test_every_build_of_the_conv_update_spills_nothing(unit, arch, spill_stores):
    # Widths 2-4, each a channel a thread (v) and four as vectors of fp32, fp16 and bf16, the vectors
    # built twice: a batch of 8 tokens, and one of 2 held to 64 registers by its launch bounds (16
    # blocks an SM) for calls of at most 2 tokens a request. A thread holds its 4 channels' weights,
    # window and token batch in registers (kernels/conv_update.cuh), so any spill is a slowdown.
    spills = {name: n for name, n in spill_stores(unit, arch).items()
              if "conv_update_kernel" in name}
    short = [name for name in spills if name.endswith("Li2EEEvNS_16ConvUpdateParamsE")]
    assert len(spills) == 3 * (1 + 3 * 2) and len(short) == 3 * 3
    assert {name: n for name, n in spills.items() if n > allowed_bytes(arch, name)} == {}
    # And vLLM's Kimi K3 KDA layer step's: width 4, bf16, its fp32 tap-major weight, at most 2 tokens,
    # on SD pages and on DS pages (whole windows, one token a row).
    taps = {name: n for name, n in spill_stores(unit, arch).items() if "conv_update_f32_taps" in name}
    assert list(taps.values()) == [0, 0], taps


@pytest.mark.parametrize("arch, unit", [("9.0a", "mtp_float32.cu")])
def test_the_convs_split_holds_three_staged_step_blocks(unit, arch, shared_memory):
    # Every conv asks for the shared-memory split the staged step kernel after it runs in
    # (kConvCarveout, kernels/conv_update.cuh), so that the SM need not drain to change splits
    # between them. That split must hold the step's three blocks an SM: their static shared memory
    # and the 1 KB the driver keeps for each, within the percentage of an sm_90's 228 KB. Its launch
    # builds both decays with either load kind, all the same size: KDA's for three blocks an SM,
    # GDN's for four (which run three to an SM in this split).
    source = (ROOT / "kernels" / "conv_update.cuh").read_text()
    percent = int(re.search(r"constexpr int kConvCarveout = (\d+);", source).group(1))
    staged = {name: n for name, n in shared_memory(unit, arch).items() if "decode_vk_one_staged_kernel" in name}
    # decode_vk_one_staged_kernel<128, float, PER_CHANNEL, STREAM, MIN_BLOCKS>: KDA's decay (a gate a
    # channel) at three blocks an SM, GDN's at four.
    blocks = {re.search(r"ILi128EfLb(\d)ELb\dELi(\d)EE", name).groups() for name in staged}
    assert len(staged) == 4 and len(set(staged.values())) == 1 and blocks == {("1", "3"), ("0", "4")}, staged
    smem = next(iter(staged.values()))
    needed, asked = 3 * (smem + 1024), percent * 228 * 1024 // 100
    # The driver rounds a percentage up to the next split it has (100, 132, 164 KB ...): asking for
    # at most 132 KB takes the 132 KB split, which the three blocks need (100 KB would not hold them).
    assert 100 * 1024 < needed <= asked <= 132 * 1024, (smem, percent)
