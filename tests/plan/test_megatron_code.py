"""plan's reading of the installed megatron-core where releases keep different tensors for backward, and
Megatron-FSDP's gradient and master buffers of each release."""

from __future__ import annotations

import pytest
from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.plan import megatron_code


def test_the_permute_selection_is_read_from_the_installed_code() -> None:
    """0.17-0.19 select the permuted rows by an argsort (and keep all of it); 0.13 and 0.16 by masked_select
    (``permute`` read in 0.13.1, 0.16.1, 0.17.1, 0.18.2, 0.19.2)."""
    installed = megatron_core_version()
    assert megatron_code.permute_selects_by_argsort() == (installed is not None and installed >= Version("0.17"))


@pytest.mark.parametrize(
    ("release", "argsort"), [("0.16.1", False), ("0.17.1", True), ("0.18.2", True), ("0.19.2", True)]
)
def test_the_permute_selection_follows_the_release_a_record_was_measured_on(release: str, argsort: bool) -> None:
    with megatron_code.as_measured_on(release):
        assert megatron_code.permute_selects_by_argsort() is argsort


def test_megatron_fsdps_gradient_layout_is_read_from_the_installed_code() -> None:
    """Megatron-FSDP's main-grad buffer follows ``grad_reduce_in_fp32`` up to 0.18 (0.13 has no Megatron-FSDP:
    0.16's answer) and not from 0.19; every release casts the gradient shard to the masters' dtype and keeps
    fp32 masters by default."""
    installed = megatron_core_version()
    assert megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32() == (
        installed is None or installed < Version("0.19")
    )
    assert megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype()
    assert megatron_code.megatron_fsdp_keeps_fp32_masters()


@pytest.mark.parametrize(
    ("release", "fp32_buffer"), [("0.16.1", True), ("0.17.1", True), ("0.18.2", True), ("0.19.2", False)]
)
def test_megatron_fsdps_gradient_layout_follows_the_release_a_record_was_measured_on(
    release: str, fp32_buffer: bool
) -> None:
    with megatron_code.as_measured_on(release):
        assert megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32() == fp32_buffer
        assert megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype()
        assert megatron_code.megatron_fsdp_keeps_fp32_masters()


# The shapes of the code the readers look at, one a release (the lines that decide, not megatron's files):
_BUFFER_016 = """
class ParamAndGradBuffer:
    def __init__(self, ddp_config, module, preserve_fp32_weights=True, grad_reduce_in_fp32=True):
        pass

    def update_main_grads(self):
        for name, param in self.optimizer_named_parameters:
            optimizer_grad = gbuf.get_item(item_id, only_shard=True)
            if group.main_weight_buffer is not None:
                optimizer_grad = optimizer_grad.to(param.dtype)
"""
_BUFFER_017 = """
class ParamAndGradBuffer:
    def __init__(self, ddp_config, module, mp_policy):
        pass

    def update_main_grads(self):
        for name, param in self.optimizer_named_parameters:
            optimizer_grad = gbuf.get_item(item_id, only_shard=True)
            if group.main_weight_buffer is not None and not self.use_decoupled_grad:
                optimizer_grad = optimizer_grad.to(param.dtype)
"""
_ADAPTER_016 = """
class FullyShardedDataParallel:
    def __init__(self, config, ddp_config, module):
        self.ddp_config = ddp_config
"""
_ADAPTER_017 = """
class FullyShardedDataParallel:
    def __init__(self, config, ddp_config, module):
        self.mp_policy = MixedPrecisionPolicy(
            main_params_dtype=ddp_config.megatron_fsdp_main_params_dtype,
            main_grads_dtype=(
                torch.float32 if ddp_config.grad_reduce_in_fp32 else ddp_config.megatron_fsdp_main_grads_dtype
            ),
        )
"""
_ADAPTER_019 = """
class FullyShardedDataParallel:
    def __init__(self, config, ddp_config, module):
        self.mp_policy = MixedPrecisionPolicy(
            main_params_dtype=ddp_config.megatron_fsdp_main_params_dtype,
            main_grads_dtype=ddp_config.megatron_fsdp_main_grads_dtype,
        )
"""
_CONFIG_016 = "class DistributedDataParallelConfig:\n    preserve_fp32_weights: bool = True\n"
_CONFIG_017 = (
    "class DistributedDataParallelConfig:\n    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32\n"
)
_CONFIG_NO_MASTERS = (
    "class DistributedDataParallelConfig:\n    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = None\n"
)


@pytest.mark.parametrize(
    ("adapter", "buffer", "config", "fp32_buffer", "masters"),
    [
        (_ADAPTER_016, _BUFFER_016, _CONFIG_016, True, True),  # 0.16.1: the buffer takes grad_reduce_in_fp32
        (_ADAPTER_017, _BUFFER_017, _CONFIG_017, True, True),  # 0.17.1, 0.18.2: "Grandfathered Argument"
        (_ADAPTER_019, _BUFFER_017, _CONFIG_017, False, True),  # 0.19.2: the policy's own field alone
        (_ADAPTER_019, _BUFFER_017, _CONFIG_NO_MASTERS, False, False),
    ],
)
def test_megatron_fsdps_gradient_layout_is_read_from_each_releases_code_shape(
    adapter: str, buffer: str, config: str, fp32_buffer: bool, masters: bool, monkeypatch
) -> None:
    """The readers on the code shapes of 0.16.1, 0.17.1 / 0.18.2 (wheels read, not installed here) and 0.19.2."""
    import ast

    files = {
        "distributed/fsdp/mcore_fsdp_adapter.py": adapter,
        "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py": buffer,
        "distributed/distributed_data_parallel_config.py": config,
    }
    monkeypatch.setattr(megatron_code, "_tree", lambda relative: ast.parse(files[relative]))
    readers = (
        megatron_code._installed_megatron_fsdp_grads_follow_grad_reduce_in_fp32,
        megatron_code._installed_megatron_fsdp_casts_grads_to_the_masters_dtype,
        megatron_code._installed_megatron_fsdp_keeps_fp32_masters,
    )
    for reader in readers:
        reader.cache_clear()
    try:
        assert megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32() == fp32_buffer
        assert megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype()
        assert megatron_code.megatron_fsdp_keeps_fp32_masters() == masters
    finally:
        for reader in readers:
            reader.cache_clear()


_ROOT_PRE_BACKWARD_016 = """
class MegatronFSDP:
    def _register_fsdp_hooks(self, root_module):
        def _root_pre_backward(module, *unused):
            if self.ddp_config.data_parallel_sharding_strategy == "optim_grads_params":
                for module in root_module.modules():
                    if isinstance(module, tuple(fsdp_unit_modules)):
                        module._training_state = TrainingState.PRE_BACKWARD
"""
_ROOT_PRE_BACKWARD_018 = """
class MegatronFSDP:
    def _register_fsdp_hooks(self, root_module):
        def _root_pre_backward(module, *unused, skip_backward_hook=False):
            if self.data_parallel_sharding_strategy == "optim_grads_params":
                for sub_module in root_module.modules():
                    sub_module._training_state = TrainingState.PRE_BACKWARD
"""


@pytest.mark.parametrize(("code", "regathers"), [(_ROOT_PRE_BACKWARD_016, True), (_ROOT_PRE_BACKWARD_018, False)])
def test_megatron_fsdps_forward_end_regather_is_read_from_each_releases_code_shape(
    code: str, regathers: bool, monkeypatch
) -> None:
    """0.16.1 / 0.17.1 mark only the FSDP units PRE_BACKWARD before the backward (the modules outside them
    keep prefetching at their forward); 0.18.2 / 0.19.2 mark every submodule."""
    import ast

    monkeypatch.setattr(megatron_code, "_tree", lambda relative: ast.parse(code))
    reader = megatron_code._installed_megatron_fsdp_regathers_the_units_at_the_forward_end
    reader.cache_clear()
    try:
        assert megatron_code.megatron_fsdp_regathers_the_units_at_the_forward_end() == regathers
    finally:
        reader.cache_clear()
