"""The vLLM profile's builds (kernels/mtp_common.cuh; the streaming, few-token and one-token kernels have them)
run a call with fix_vllm_profile's constants in place of the call's own fields; vllm_profile decides
which calls take them. Were fix_vllm_profile to set a field that vllm_profile does not ask for, a
call that differs there would take the build and run with a value it never had. Here both, compiled
into a host program, meet every call one flipped byte away from vLLM's: each that vllm_profile still
takes must be left as it was by fix_vllm_profile (z's dtype aside where there is no epilogue: z is
not read). A copy of the fix that sets one field more (the norm weight's dtype) shows the check
catches such a drift."""

import pytest
from host_probe import run_host_probe

PROBE = r"""
#include <cstdio>
#include <cstring>
#include "mtp_common.cuh"
using cudelta::DType;
using cudelta::GdnDecodeParams;

// vLLM's call as its layer makes it, in the fields vllm_profile reads; the rest zero.
GdnDecodeParams vllm_call(int gate_activation) {
  GdnDecodeParams p{};
  p.dtype = p.z_dtype = p.g_dtype = p.beta_dtype = DType::kBFloat16;
  p.gate_raw = p.beta_raw = p.use_qk_l2norm = true;
  p.V = 128;
  p.gate_activation = gate_activation;
  return p;
}

void drifted_fix(GdnDecodeParams& p) {
  cudelta::fix_vllm_profile(p);
  p.norm_weight_dtype = DType::kBFloat16;
}

// Whether fix leaves the call p as it was, byte for byte.
template <typename Fix>
bool unchanged(const GdnDecodeParams& p, Fix fix) {
  GdnDecodeParams q;
  std::memcpy(&q, &p, sizeof q);
  fix(q);
  if (p.gate_activation == 0) q.z_dtype = p.z_dtype;
  return std::memcmp(&p, &q, sizeof q) == 0;
}

int main() {
  for (int act : {0, 1}) {
    const GdnDecodeParams base = vllm_call(act);
    // "-1": vLLM's call itself; then each byte flipped that leaves the call in the profile.
    for (long i = -1; i < static_cast<long>(sizeof base); ++i) {
      GdnDecodeParams p;
      std::memcpy(&p, &base, sizeof p);
      if (i >= 0) reinterpret_cast<unsigned char*>(&p)[i] ^= 1;
      if (!cudelta::vllm_profile(p)) continue;
      std::printf("%d %ld %d %d\n", act, i, int(unchanged(p, cudelta::fix_vllm_profile)), int(unchanged(p, drifted_fix)));
    }
  }
}
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> list[tuple[int, int, bool, bool]]:
    """(epilogue, flipped byte (-1: none), the fix leaves the call as it was, the drifted fix does) for
    each call vllm_profile takes."""
    out = run_host_probe(PROBE, tmp_path_factory.mktemp("vllm_profile"))
    return [(int(a), int(i), u == "1", d == "1") for a, i, u, d in (line.split() for line in out.splitlines())]


def test_vllms_call_is_in_the_profile_with_and_without_the_epilogue(answers):
    assert {(act, i) for act, i, *_ in answers if i < 0} == {(0, -1), (1, -1)}


def test_the_profile_fixes_no_field_it_does_not_ask_for(answers):
    # Many one-byte departures stay in the profile (the fields it leaves to the call: pointers,
    # strides, sizes), so the check meets calls that differ from vLLM's outside what it asks for.
    assert sum(i >= 0 for _, i, *_ in answers) > 100
    assert [(act, i) for act, i, same, _ in answers if not same] == []


def test_a_fix_that_sets_one_field_more_is_caught(answers):
    assert all(not drifted for *_, drifted in answers)
