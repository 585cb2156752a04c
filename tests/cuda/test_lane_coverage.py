"""The CUDA lane covers every acceleration the registry lists, or says why one GPU cannot (no device
needed: this runs wherever the lane is collected, `make test` included)."""

from __future__ import annotations

import pytest
from cuda_lane import CASES, NOT_ON_ONE_GPU, accelerations, parity_cases

pytestmark = pytest.mark.cuda


def test_every_acceleration_is_in_the_lane_or_says_why_not():
    names = {f.name for f in accelerations()}
    assert len(names) >= 10  # the registry was read, not an empty list
    covered = {case.feature for case in parity_cases()}
    missing = names - covered - set(NOT_ON_ONE_GPU)
    assert not missing, f"accelerations neither in the CUDA lane nor in cuda_lane.NOT_ON_ONE_GPU: {sorted(missing)}"
    both = covered & set(NOT_ON_ONE_GPU)
    assert not both, f"in the lane and listed as impossible on one GPU: {sorted(both)}"
    stale = (set(CASES) | set(NOT_ON_ONE_GPU)) - names
    assert not stale, f"cuda_lane names features that do not exist: {sorted(stale)}"
    assert all(NOT_ON_ONE_GPU[name].strip() for name in NOT_ON_ONE_GPU)


def test_a_feature_switched_on_by_megatrons_config_has_its_own_case():
    """The default case switches a feature on by its ``switch_on``; one without (megatron's own config
    asks for it) needs a case that sets that config, or a reason in NOT_ON_ONE_GPU."""
    lacking = [f.name for f in accelerations() if not f.switch_on and f.name not in CASES | NOT_ON_ONE_GPU]
    assert not lacking, f"no switch_on and no case in cuda_lane.CASES: {lacking}"


def test_case_ids_are_unique_and_bounds_stated():
    cases = parity_cases()
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for case in cases:
        assert case.why.strip(), case.id
        assert case.rtol is None or 0 < case.rtol < 0.1, case.id
