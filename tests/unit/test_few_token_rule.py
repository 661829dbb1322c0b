"""The GPU tests of the few-token kernel pick their batches from a Python copy of its launch rule
(mtp_cases.takes_the_few_token_kernel): were the two to drift apart, those tests would run another
kernel and still pass. Here the rule itself (kernels/mtp_few.cuh, few_token_call), compiled into a
host program, answers for every batch of a grid of calls and the copy must give the same answers;
so does the rule of its clusters (few_cluster_blocks, against mtp_cases.few_cluster_blocks)."""

import sys
from pathlib import Path

import pytest
from host_probe import run_host_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/mtp_cases.py
import mtp_cases as mc  # noqa: E402

PROBE = r"""
#include <cstdio>
#include "mtp_few.cuh"
// call: 0 a call off vLLM's profile (its dtypes left zero), 1 vLLM's call on an sm_90 image, 2 on sm_100.
int main() {
  for (int sms : {114, 132}) for (int cols = 0; cols <= 5; ++cols) for (int fp32 = 0; fp32 < 2; ++fp32)
    for (int call = 0; call < 3; ++call) for (int n = 1; n <= 2200; n += n < 600 ? 1 : 7) {
      cudelta::GdnDecodeParams p{};
      p.idx_columns = cols; p.state_vk = true; p.K = 128; p.V = 128; p.H = 4; p.HV = 8; p.N = n; p.sm_count = sms;
      p.clusters = true; p.gate_activation = 1;
      if (call > 0) {
        p.dtype = p.z_dtype = p.g_dtype = p.beta_dtype = cudelta::DType::kBFloat16;
        p.gate_raw = p.beta_raw = p.use_qk_l2norm = true;
        p.image_arch = call == 1 ? 900 : 1000;
      }
      const bool takes = fp32 ? cudelta::few_token_call<float>(p) : cudelta::few_token_call<__nv_bfloat16>(p);
      const int cl = fp32 ? cudelta::few_cluster_blocks<float>(p) : cudelta::few_cluster_blocks<__nv_bfloat16>(p);
      std::printf("%d %d %d %d %lld %d %d\n", sms, cols, fp32, call, static_cast<long long>(p.N * p.HV), int(takes), cl);
    }
}
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> list[tuple[int, int, bool, int, int, bool, int]]:
    """(SMs, idx columns, fp32, call (0 off vLLM's profile, 1 vLLM's on sm_90, 2 on sm_100), pairs,
    takes the few-token kernel, its cluster blocks) a call."""
    lines = run_host_probe(PROBE, tmp_path_factory.mktemp("few_rule")).split("\n")
    return [(int(a), int(b), c == "1", int(d), int(e), f == "1", int(g))
            for a, b, c, d, e, f, g in (line.split() for line in lines if line)]


def test_the_tests_copy_of_the_few_token_rule_is_the_rule(answers):
    assert len(answers) == 2 * 6 * 2 * 3 * (599 + len(range(600, 2201, 7)))
    # The grid reaches every side of the rule: both kinds of call taken and refused, each cap crossed.
    assert {(cols, fp32) for _, cols, fp32, _, _, takes, _ in answers if takes} == {(2, False), (2, True), (3, False),
                                                                                 (3, True), (4, False), (4, True)}
    assert any(pairs > 128 * sms for sms, cols, fp32, _, pairs, _, _ in answers if cols == 2 and fp32)
    # bf16 past two pairs an SM: vLLM's call on sm_90 only
    assert {call for sms, cols, fp32, call, pairs, takes, _ in answers if cols == 2 and not fp32 and pairs > 2 * sms
            and takes} == {1}
    # bf16 at three or four columns: vLLM's call on sm_90 only, in waves of one block an SM (2.7-3 of
    # them, 1.35-1.5 waves of fp32's two blocks an SM, taken)
    assert {call for _, cols, fp32, call, _, takes, _ in answers if cols > 2 and not fp32 and takes} == {1}
    assert any(cols == 4 and not fp32 and call == 1 and takes and 2.7 * sms <= pairs <= 3 * sms
               for sms, cols, fp32, call, pairs, takes, _ in answers)
    assert not any(cols == 4 and fp32 and takes and 2.7 * sms <= pairs <= 3 * sms
                   for sms, cols, fp32, call, pairs, takes, _ in answers)
    assert max(pairs / sms for sms, cols, fp32, _, pairs, takes, _ in answers if cols > 2 and takes and not fp32) <= 4
    assert any(pairs > 4 * sms for sms, cols, fp32, _, pairs, takes, _ in answers if cols > 2 and takes and fp32)
    differ = [a for a in answers if mc.takes_the_few_token_kernel(a[4], a[0], a[2], a[1], profile_on_sm90=a[3] == 1) != a[5]]
    assert differ == []


def test_the_tests_copy_of_the_few_token_cluster_rule_is_the_rule(answers):
    assert {cl for *_, cl in answers} == {1, 2, 4}  # each size reached, both SM counts
    differ = [a for a in answers if mc.few_cluster_blocks(a[4], a[0], a[2], a[1], epilogue=True) != a[6]]
    assert differ == []
