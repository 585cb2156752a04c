"""pytest fixtures of mindspeed_like.testing, for this project's tests and downstream ones.

Register it in a conftest::

    pytest_plugins = ["mindspeed_like.testing.pytest_plugin"]

``kernel_backend``: the test runs once per kernel backend (``portable``, ``reference``,
``npu``), with that backend forced and the torch_npu emulator installed (for every backend, so
its counts also prove portable and reference never call torch_npu). It yields a
:class:`~mindspeed_like.testing.parity.KernelBackend`::

    def test_my_op(kernel_backend):
        out = my_op(x)
        kernel_backend.assert_npu_calls("npu_my_op", 1)   # 1 on npu, 0 elsewhere
        assert_close_to_reference(out, my_op_f64(x.double()), x.dtype)

A subset of backends: ``@pytest.mark.parametrize("kernel_backend", ["portable", "npu"],
indirect=True)`` (also combined with other arguments, ``indirect=["kernel_backend"]``).
"""

from __future__ import annotations

import pytest

from mindspeed_like.testing.parity import BACKENDS, run_with_backend


@pytest.fixture(params=BACKENDS)
def kernel_backend(request):
    with run_with_backend(request.param) as backend:
        yield backend
