"""The opt-in Megatron-LM tests run only against a checkout of the installed megatron-core's tag.

The checkout's pretrain_gpt.py puts its own folder first on sys.path, so its megatron/core is what
runs: with a core_v0.16.1 checkout in MEGATRON_LM_PATH the version lane's 0.17.1 venv ran 0.16.1 code
(and failed on Megatron-LM's imports that venv lacks, ``No module named 'six'``). They now skip with
the reason naming both tags (``workloads/megatron_lm.checkout_mismatch``)."""

from __future__ import annotations

from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version, package_info_version
from mindspeed_like.workloads import megatron_lm


def _checkout(root, version: str):
    major, minor, patch = version.split(".")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
    (root / "pretrain_gpt.py").write_text("")
    return root


def test_package_info_version_reads_the_file(tmp_path):
    assert package_info_version(str(_checkout(tmp_path, "0.17.1") / "megatron/core/package_info.py")) == Version(
        "0.17.1"
    )
    assert package_info_version(str(tmp_path / "absent.py")) is None


def test_mismatch_names_both_tags(tmp_path):
    root = str(_checkout(tmp_path, "0.16.1"))
    reason = megatron_lm.checkout_mismatch(root, installed=Version("0.17.1"))
    assert "core_v0.16.1" in reason and "megatron-core 0.17.1 is installed" in reason
    assert "a core_v0.17.1 checkout" in reason
    assert megatron_lm.checkout_mismatch(root, installed=Version("0.16.1")) is None
    # no megatron/core to read (not a checkout) or no MEGATRON_LM_PATH: nothing said here
    assert megatron_lm.checkout_mismatch(str(tmp_path / "elsewhere"), installed=Version("0.17.1")) is None
    assert megatron_lm.checkout_mismatch("", installed=Version("0.17.1")) is None


def test_available_only_for_the_installed_release(tmp_path, monkeypatch):
    installed = megatron_core_version()
    other = f"{installed.major}.{installed.minor + 1}.0"
    for version, expected in ((str(installed), True), (other, False)):
        root = _checkout(tmp_path / version, version)
        monkeypatch.setattr(megatron_lm, "MEGATRON_LM", str(root))
        monkeypatch.setattr(megatron_lm, "PRETRAIN_GPT", str(root / "pretrain_gpt.py"))
        assert megatron_lm.available() is expected, version
