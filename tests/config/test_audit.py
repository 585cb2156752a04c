"""``mindspeed-like audit``: declared patch targets read statically from a megatron-core source.

The installed release audited against itself must be clean (every applicable target present,
every signature "same"); a copy with a module removed and a signature changed must be reported
as such, and the command must exit non-zero for a missing non-optional target.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from mindspeed_like import audit, cli


@pytest.fixture(scope="module")
def installed() -> audit.Source:
    source = audit.installed_source()
    assert source is not None, "megatron-core is not installed"
    return source


def test_installed_release_against_itself_is_clean(installed):
    rows = audit.audit(installed, installed)
    assert rows, "no megatron patch targets declared"
    assert audit.failures(rows) == []
    applicable = [r for r in rows if r.status != audit.NOT_APPLICABLE]
    assert all(r.status in (audit.PRESENT, audit.ABSENT_OPTIONAL) for r in applicable), applicable
    assert {r.signature for r in applicable if r.status == audit.PRESENT} <= {"same", "-"}


@pytest.fixture(scope="module")
def damaged(installed, tmp_path_factory) -> str:
    """A copy of the installed megatron/core with one feature's module removed and one patched
    function's signature changed (the module is never imported: the audit only parses)."""
    root = tmp_path_factory.mktemp("megatron-src")
    core = os.path.join(installed._root, "megatron", "core")
    shutil.copytree(core, root / "megatron" / "core", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # the target the audit must report, taken from the declarations (not hard-coded)
    rows = audit.audit(installed, installed)
    required = next(r for r in rows if r.status == audit.PRESENT and not r.optional and r.feature == "fused-swiglu")
    return str(root), required


def test_removed_module_and_changed_signature_are_reported(installed, damaged):
    root, required = damaged
    rope = os.path.join(root, "megatron", "core", "models", "common", "embeddings", "rope_utils.py")
    with open(rope, encoding="utf-8") as handle:
        text = handle.read()
    assert "def apply_rotary_pos_emb(" in text
    with open(rope, "w", encoding="utf-8") as handle:
        handle.write(text.replace("def apply_rotary_pos_emb(", "def apply_rotary_pos_emb(extra_arg, ", 1))
    module_file = required.target.rsplit(".", 2)[0].replace(".", os.sep)
    for candidate in (module_file + ".py", required.target.rsplit(".", 1)[0].replace(".", os.sep) + ".py"):
        path = os.path.join(root, candidate)
        if os.path.exists(path):
            os.remove(path)
            break
    else:
        pytest.fail(f"no module file for {required.target}")
    rows = audit.audit(audit.Source(root), installed)
    by_target = {(r.feature, r.target): r for r in rows}
    broken = by_target[(required.feature, required.target)]
    assert broken.status in (audit.MISSING, audit.MODULE_REMOVED)
    assert broken in audit.failures(rows)
    rope_row = next(r for r in rows if r.target.endswith("rope_utils.apply_rotary_pos_emb"))
    assert rope_row.signature == "changed: +extra_arg"
    assert audit.feature_summary(rows)[required.feature].startswith("BROKEN")


@pytest.mark.slow
def test_cli_exit_status(installed, damaged, capsys, monkeypatch):
    root, required = damaged
    monkeypatch.setattr(sys, "argv", ["mindspeed-like"])
    assert cli.main(["audit", "--megatron-source", installed._root, "--against", installed._root]) == 0
    assert cli.main(["audit", "--megatron-source", root, "--against", installed._root]) == 1
    assert required.target in capsys.readouterr().err
    assert cli.main(["audit", "--megatron-source", str(os.path.dirname(root))]) == 2
