"""TE's weight initialisation without megatron's RNG tracker.

megatron hands TE's modules ``get_rng_state_tracker=None`` while its CUDA RNG tracker is not
initialised (nobody called ``model_parallel_cuda_manual_seed``), and TE then runs ``init_method``
on the default generator; megatron's own parallel linears, which the te-backend's TE classes are
built on, always fork the tracker and stop with "cuda rng state model-parallel-rng is not added"
(or expert-parallel-rng). Scripts and megatron's unit tests that build TE-spec modules without
seeding (tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py) ran with TE and
stopped with the te-backend. While the tracker is not initialised, :func:`te_initialization`
makes its ``fork`` a no-op on that one tracker object for the construction only, which is exactly
TE's behaviour: the weights come from the default generator. An initialised tracker is untouched
(TE forks it, by the same names megatron's layers use).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from mindspeed_like.toolkit.overrides import attributes_set


@contextlib.contextmanager
def _no_fork(*_args: object, **_kwargs: object) -> Iterator[None]:
    yield


@contextlib.contextmanager
def te_initialization() -> Iterator[None]:
    """Construct a TE module under TE's RNG rule (see the module docstring)."""
    tracker = get_cuda_rng_tracker()
    if tracker.is_initialized():
        yield
        return
    with attributes_set(tracker, fork=_no_fork):
        yield
