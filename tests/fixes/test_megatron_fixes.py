"""Small always-on fixes of megatron behaviour that is wrong on any device."""

from __future__ import annotations

import os

import pytest

from mindspeed_like.fixes import checkpoint_writer_psutil, dataset_helpers_build


def test_checkpoint_writer_without_psutil_fails_instead_of_hanging(adaptor, monkeypatch, tmp_path):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "HAVE_PSUTIL", False)
    with pytest.raises(checkpoint_writer_psutil.CheckpointDependencyError, match="pip install psutil"):
        filesystem_async.FileSystemWriterAsync(tmp_path)
    monkeypatch.setattr(filesystem_async, "HAVE_PSUTIL", True)
    filesystem_async.FileSystemWriterAsync(tmp_path)  # constructs as before when psutil is there


def test_dataset_helpers_build_for_the_running_interpreter(adaptor):
    import sysconfig

    from megatron.core.datasets import utils

    assert utils.compile_helpers is dataset_helpers_build.compile_helpers
    command = dataset_helpers_build.make_command(os.path.dirname(utils.__file__))
    assert f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}" in command
    assert any(part.startswith("CPPFLAGS=") and sysconfig.get_paths()["include"] in part for part in command)


def test_wheel_without_makefile_uses_its_prebuilt_helpers(adaptor):
    """The megatron-core wheel has helpers_cpp prebuilt and no Makefile: megatron's own
    compile_helpers exits there; ours keeps the prebuilt module."""
    from megatron.core.datasets import utils

    directory = os.path.dirname(utils.__file__)
    if os.path.exists(os.path.join(directory, "Makefile")):
        pytest.skip("this megatron-core comes from a source checkout (it has the Makefile)")
    utils.compile_helpers()  # would sys.exit(1) if it could not use the prebuilt module
    from megatron.core.datasets import helpers_cpp  # noqa: F401
