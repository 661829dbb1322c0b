"""The run-time guards that turn a mismatched library into an actionable error before dlopen."""

import pytest

pytest.importorskip("torch")

from cudelta import _build_record, _native  # noqa: E402
from decode_loop import inputs, loop_reference  # noqa: E402
from kernel_table import variant_table  # noqa: E402

INFO = {"cuda_toolkit": "13.0", "archs": ["sm_80", "sm_90a"], "ptx": ["compute_120"], "torch_floor": "2.10"}


def test_any_cuda_build_of_torch_above_the_floor_loads_it():
    # The runtime is linked statically: torch's own CUDA version does not matter, the driver does.
    for torch_version, torch_cuda in [("2.11.0+cu130", "13.0"), ("2.10.0+cu128", "12.8"), ("2.14.1+cu132", "13.2")]:
        assert _native.compatibility_problem(INFO, torch_version, torch_cuda, (13, 0)) is None


def test_a_driver_older_than_the_toolkit_major_names_both_and_the_reinstall_command():
    msg = _native.compatibility_problem(INFO, "2.11.0+cu128", "12.8", (12, 8))
    assert "CUDA 12.8" in msg and ">= 13.0" in msg and _build_record.REINSTALL in msg and "--no-deps" in msg


def test_an_unseen_driver_is_not_a_reason_to_refuse():
    assert _native.compatibility_problem(INFO, "2.11.0+cu130", "13.0", None) is None


def test_the_record_s_driver_floor_wins_over_the_toolkit_major():
    assert _native.driver_floor({**INFO, "driver_floor": "12.4"}) == (12, 4)
    assert _native.driver_floor(INFO) == (13, 0)


def test_torch_below_the_stable_abi_floor():
    msg = _native.compatibility_problem(INFO, "2.9.1+cu130", "13.0", (13, 0))
    assert "2.10" in msg and "torch>=2.10" in msg


def test_cpu_torch_cannot_use_the_cuda_library():
    assert "CPU build" in _native.compatibility_problem(INFO, "2.13.0+cpu", None, (13, 0))


# The library's own table (kernels/launch.h kVariants, served as cudelta::variants); no library is built here.
TABLE = variant_table()


def test_the_table_read_from_the_header_has_every_variant_in_id_order():
    # launch.h's static_assert keeps kVariants in id order; the ids are what the ops take.
    assert list(TABLE.values()) == list(range(len(TABLE)))
    assert {"generic", "warp"} <= set(TABLE)


@pytest.mark.parametrize("name", list(TABLE))
def test_every_variant_of_the_library_can_be_requested_in_any_case(name):
    assert _native.requested_variant({"CUDELTA_KERNEL_VARIANT": name.upper()}, TABLE) == TABLE[name]


@pytest.mark.parametrize("raw", ["", "auto", " AUTO "])
def test_auto_or_unset_lets_the_library_choose(raw):
    assert _native.requested_variant({"CUDELTA_KERNEL_VARIANT": raw}, TABLE) == -1
    assert _native.requested_variant({}, TABLE) == -1


def test_bad_kernel_variant_names_every_accepted_value():
    with pytest.raises(ValueError) as err:
        _native.requested_variant({"CUDELTA_KERNEL_VARIANT": "sm100"}, TABLE)
    assert str(err.value) == (f"CUDELTA_KERNEL_VARIANT='sm100' is not accepted; expected one of: auto, "
                              f"{', '.join(TABLE)}")


def test_cpu_tensors_get_the_decode_step_with_or_without_a_library():
    import torch

    import cudelta

    q, k, v, g, beta, state, idx = inputs()
    before = state.clone()
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 64 ** -0.5, False)
    out = cudelta.gdn_decode(q, k, v, g, beta, state, idx)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)  # slots -1 and 9 (>= P): skipped
    for s in (1, 2, 4, 5):
        assert torch.equal(state[s], before[s])


def test_the_reference_notice_comes_once():
    import warnings

    import torch

    import cudelta

    _native._noticed.discard("cpu")
    args = (torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.zeros(1, 1),
            torch.ones(1, 1), torch.zeros(2, 1, 64, 64), torch.tensor([0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cudelta.gdn_decode(*args)
        cudelta.gdn_decode(*args)
    notices = [w for w in caught if "PyTorch reference" in str(w.message)]
    assert len(notices) == 1


def test_kda_on_cpu_decays_each_channel():
    import torch

    import cudelta

    q, k, v, g, beta, state, idx = inputs(kda=True)
    assert g.shape == (5, 4, 64)  # a log-decay per channel
    expected_state = state.clone()
    expected = loop_reference(q, k, v, g, beta, expected_state, idx, 0.5, True)
    out = cudelta.kda_decode(q, k, v, g, beta, state, idx, scale=0.5, use_qk_l2norm=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
