"""megatron-fsdp-lean-state on a megatron-core release with a Megatron-FSDP but no lean layout (0.13's
custom_fsdp, 0.14's and 0.15's Megatron-FSDP: ``NO_LAYOUT``): a wrapper built with the feature on says so
once, through the feature's fallback, and an error under --strict; nothing at configure or import, nothing
with the feature off. Before this line such a user kept megatron's 18/DP bytes a parameter in silence.

Runs where the installed release has no layout (the version lane's 0.13.1; 0.14.0, 0.15.3), skipped with
the reason elsewhere. One spawn, one rank: megatron's own constructor may stop after the line on this host
(0.13: custom_fsdp is not adapted to a CPU host; 0.14/0.15: their mesh code reads what torch 2.13 no longer
has), which the worker records; the line comes first."""

from __future__ import annotations

import lean_state_workers as workers
import pytest
from packaging.specifiers import SpecifierSet

from mindspeed_like.features.megatron_fsdp_lean_state import NAME, NO_LAYOUT
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.testing import run_distributed

RELEASE = megatron_core_version()
LINE = next(
    (line for _, versions, line in NO_LAYOUT if RELEASE is not None and RELEASE in SpecifierSet(versions)), None
)

pytestmark = pytest.mark.skipif(
    LINE is None,
    reason=f"megatron-fsdp-lean-state serves a layout on the installed megatron-core {RELEASE} (or none is "
    "installed): there is no line to say",
)


@pytest.fixture(scope="module")
def cases():
    return run_distributed(workers.no_layout_cases, 1, timeout=600)[0]


def _lines(said: list[str]) -> list[str]:
    return [message for message in said if message.startswith(f"{NAME}:")]


def test_the_line_is_said_once_when_a_wrapper_is_built(cases):
    run = cases[(True, False)]
    expected = LINE.format(release=RELEASE)
    assert _lines(run["before"]) == []  # configured and imported: nothing yet
    assert _lines(run["said"]) == [f"{NAME}: keeping Megatron-FSDP's own buffers ({expected})"]
    assert run["fell_back"] == {NAME: [expected]}
    assert len(run["stopped"]) == workers.BUILDS  # built twice, said once
    assert not any(str(s).startswith("FeatureUnsupported") for s in run["stopped"])


def test_nothing_is_said_with_the_feature_off(cases):
    run = cases[(False, False)]
    assert _lines(run["said"]) == [] and run["fell_back"] == {}


def test_strict_refuses_the_build(cases):
    run = cases[(True, True)]
    expected = LINE.format(release=RELEASE)
    assert all(
        s == f"FeatureUnsupported: {NAME} cannot run this call ({expected}) and strict is on" for s in run["stopped"]
    )
    assert _lines(run["said"]) == []
