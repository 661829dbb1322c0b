"""The run-time guards that turn a mismatched library into an actionable error before dlopen."""

import pytest

pytest.importorskip("torch")

from cudelta import _build_record, _native  # noqa: E402

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


# The shape of the library's table (cudelta::variants, kernels/launch.h); the library is not built here.
TABLE = {"generic": 0, "sm80": 1, "sm90": 2, "sm90tma": 3}


@pytest.mark.parametrize("raw,expected", [("", -1), ("auto", -1), ("generic", 0), ("SM80", 1), ("sm90", 2)])
def test_kernel_variant_variable(raw, expected):
    assert _native.requested_variant({"CUDELTA_KERNEL_VARIANT": raw}, TABLE) == expected


def test_bad_kernel_variant_names_the_accepted_values():
    with pytest.raises(ValueError, match="CUDELTA_KERNEL_VARIANT='sm100'.*auto, generic, sm80, sm90"):
        _native.requested_variant({"CUDELTA_KERNEL_VARIANT": "sm100"}, TABLE)


def test_source_tree_has_no_library_and_cpu_tensors_use_the_reference():
    import torch

    import cudelta

    q = torch.randn(1, 1, 64)
    state = torch.zeros(2, 1, 64, 64)
    out = cudelta.gdn_decode(q, q, torch.randn(1, 1, 64), torch.zeros(1, 1), torch.ones(1, 1), state,
                             torch.tensor([1]))
    assert out.shape == (1, 1, 64) and state[1].abs().sum() > 0 and state[0].abs().sum() == 0


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


def test_kda_on_cpu_runs_the_per_channel_reference():
    import torch

    import cudelta
    from cudelta.reference import kda_decode_reference

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    v, g = torch.randn(2, 2, 64, generator=gen), -torch.rand(2, 2, 64, generator=gen)
    beta, state = torch.rand(2, 2, generator=gen), torch.randn(3, 2, 64, 64, generator=gen)
    ref_state = state.clone()
    expected = kda_decode_reference(q, k, v, g, beta, ref_state, torch.tensor([2, 0]))
    out = cudelta.kda_decode(q, k, v, g, beta, state, torch.tensor([2, 0]))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, ref_state)
