"""mindspeed_like.testing.parity: the bounds and messages every parity test relies on."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_like.testing.parity import (
    TOLERANCES,
    assert_close_to_reference,
    assert_elementwise_close,
    assert_losses_close,
    assert_losses_equal,
    max_relative_error,
    rel_close,
    run_with_backend,
    tolerance,
)


def test_every_tolerance_says_why():
    assert set(TOLERANCES) == {torch.float32, torch.bfloat16}
    for entry in TOLERANCES.values():
        assert entry.rtol > 0 and entry.atol > 0 and len(entry.why) > 40


def test_unknown_dtype_names_the_known_ones():
    with pytest.raises(KeyError, match="float16.*known: torch.float32, torch.bfloat16"):
        tolerance(torch.float16)


def test_error_is_relative_to_the_references_largest_magnitude():
    ref = torch.tensor([100.0, 1e-9], dtype=torch.float64)
    # 1e-3 off on the tiny element: huge per element, 1e-5 of the tensor's scale.
    assert max_relative_error(torch.tensor([100.0, 1e-3]), ref) == pytest.approx(1e-5, rel=1e-6)
    assert_close_to_reference(torch.tensor([100.0, 1e-3]), ref, tol=2e-5)
    with pytest.raises(AssertionError, match=r"out: max error 1e-05 .* exceeds 1e-06"):
        assert_close_to_reference(torch.tensor([100.0, 1e-3]), ref, tol=1e-6, what="out")


def test_a_zero_reference_must_be_matched_exactly_unless_a_floor_is_given():
    zero = torch.zeros(3, dtype=torch.float64)
    assert max_relative_error(torch.zeros(3), zero) == 0.0
    assert max_relative_error(torch.full((3,), 1e-9), zero) == math.inf
    assert_close_to_reference(torch.full((3,), 1e-9), zero, floor=1.0)
    with pytest.raises(AssertionError, match="shapes differ"):
        max_relative_error(torch.zeros(2), zero)


def test_bf16_gets_the_bf16_bound():
    ref = torch.linspace(-1, 1, 50, dtype=torch.float64)
    assert_close_to_reference(ref.to(torch.bfloat16), ref)  # 2e-2 holds one bf16 rounding
    with pytest.raises(AssertionError):
        assert_close_to_reference(ref.to(torch.bfloat16).float(), ref, torch.float32)


def test_elementwise_uses_the_table_per_element():
    ref = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert_elementwise_close(torch.tensor([1.0 + 5e-6, 5e-7]), ref)
    with pytest.raises(AssertionError, match="dx"):
        assert_elementwise_close(torch.tensor([1.0, 5e-6]), ref, what="dx")


def test_loss_curves_name_the_first_bad_step():
    assert rel_close([1.0, 2.0], [1.0, 2.0 + 1e-7], 1e-6)
    assert not rel_close([1.0, 2.0], [1.0, 2.1], 1e-6)
    with pytest.raises(ValueError):
        rel_close([1.0], [1.0, 2.0], 1e-6)
    assert_losses_close([1.0, 2.0], [1.0, 2.0 + 1e-7], rtol=1e-6)
    with pytest.raises(AssertionError, match=r"step 1: 2.0 vs 2.1 \(relative difference 0.0476 > 1e-06\)"):
        assert_losses_close([1.0, 2.0], [1.0, 2.1], rtol=1e-6)
    with pytest.raises(AssertionError, match="2 steps vs 3"):
        assert_losses_close([1.0, 2.0], [1.0, 2.0, 3.0], rtol=1e-6)


def test_equal_curves_are_compared_bit_for_bit():
    assert_losses_equal([1.0, math.nan], [1.0, math.nan])
    with pytest.raises(AssertionError, match="step 0: -0.0 vs 0.0"):
        assert_losses_equal([-0.0], [0.0])
    with pytest.raises(AssertionError, match="step 1"):
        assert_losses_equal([1.0, 2.0], [1.0, 2.0 + 2**-50])


def test_run_with_backend_forces_it_and_counts_npu_calls():
    from mindspeed_like.kernels.backend import backend_for
    from mindspeed_like.kernels.swiglu import swiglu

    for name in ("portable", "reference", "npu"):
        with run_with_backend(name) as backend:
            assert backend_for(torch.zeros(1)) == name
            swiglu(torch.randn(4, 8))
            backend.assert_npu_calls("npu_swiglu", 1)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        with run_with_backend("cuda"):
            pass


def test_kernel_backend_fixture_runs_each_backend(kernel_backend):
    from mindspeed_like.kernels.backend import backend_for

    assert backend_for(torch.zeros(1)) == kernel_backend.name
