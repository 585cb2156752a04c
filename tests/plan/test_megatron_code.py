"""plan's reading of the installed megatron-core where releases keep different tensors for backward."""

from __future__ import annotations

from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.plan import megatron_code


def test_the_permute_selection_is_read_from_the_installed_code() -> None:
    """0.19 selects the permuted rows by an argsort (and keeps all of it); 0.13 and 0.16 by masked_select."""
    installed = megatron_core_version()
    assert megatron_code.permute_selects_by_argsort() == (installed is not None and installed >= Version("0.19"))


def test_the_permute_selection_follows_the_release_a_record_was_measured_on() -> None:
    with megatron_code.as_measured_on("0.19.2"):
        assert megatron_code.permute_selects_by_argsort()
    with megatron_code.as_measured_on("0.16.1"):
        assert not megatron_code.permute_selects_by_argsort()
