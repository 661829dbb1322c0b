"""The kernels' clusters exchange their epilogue sums without a release barrier: `st.async` stores
counted by the receiving block's mbarrier (kernels/common/ptx.cuh, send_cluster). A
`barrier.cluster.arrive` without `.relaxed` releases at cluster scope, which ptxas compiles as
MEMBAR.ALL.GPU: every warp then waits for its state stores to reach L2 before its sum counts (H100,
T=1 B=1 at 16/32 heads: bf16 5.2 µs with it, 4.7 without; benchmarks/results-h100-async-sums.md).
Read from the PTX nvcc writes for sm_90a, the image whose launches take the clusters. The
streaming kernel sends from its sends build (SENDS, the last template argument), the one its
clustered launches take; its other builds keep the stores and the release barrier (the same
exchange there lost in the grids that make no cluster)."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from nvcc_unit import compile_unit

UNITS = ("mtp_bfloat16.cu", "mtp_float32.cu")
CLUSTERED = re.compile(r"decode_vk_(one_warp|few)_kernel")
RELEASE_ARRIVE = re.compile(r"barrier\.cluster\.arrive(\.aligned)?;")
STREAM_SENDS = re.compile(r"decode_mtp_stream_kernel\w*Lb1EEEvNS_15GdnDecodeParamsE$")


def ptx_entries(unit: str, out_dir) -> dict[str, str]:
    """Kernel (mangled name) -> its PTX body, for one unit compiled for sm_90a with the shipped flags."""
    out = out_dir / (unit + ".ptx")
    compile_unit(unit, "9.0a", out, "-ptx")
    bodies = re.split(r"^\.entry ", out.read_text(), flags=re.M)[1:]
    return {body.split("(", 1)[0]: body for body in bodies}


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ptx")
    with ThreadPoolExecutor(max_workers=len(UNITS)) as pool:
        found = dict(zip(UNITS, pool.map(lambda unit: ptx_entries(unit, out_dir), UNITS)))
    return found


@pytest.mark.parametrize("unit", UNITS)
def test_the_clustered_epilogues_send_their_sums_without_a_release_barrier(entries, unit):
    clustered = {name: body for name, body in entries[unit].items() if CLUSTERED.search(name) and "mapa" in body}
    # Both kernels have cluster builds in each unit (the one-token kernel's CLUSTER_EPI, the
    # few-token kernel's CL > 1): a rename that hides them fails here, not silently.
    assert any("one_warp" in name for name in clustered) and any("few" in name for name in clustered)
    assert {name for name, body in clustered.items() if "st.async" not in body} == set()
    assert {name for name, body in clustered.items() if RELEASE_ARRIVE.search(body)} == set()


@pytest.mark.parametrize("unit", UNITS)
def test_the_streaming_kernels_clustered_launches_send_their_sums(entries, unit):
    sends = {name: body for name, body in entries[unit].items() if STREAM_SENDS.search(name)}
    # Its 8-row build and the short-chunk builds (generic and vLLM's profile), GDN in layout vk.
    assert len(sends) == 3
    assert {name for name, body in sends.items() if "st.async" not in body} == set()
    # No sum goes as a plain store. (A release arrive stays in its PTX: the barrier between two
    # passes, which its calls, one pass each, never reach.)
    assert {name for name, body in sends.items() if "st.shared::cluster" in body} == set()
