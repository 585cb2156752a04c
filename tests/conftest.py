"""Shared fixtures (and mindspeed_like.testing's pytest plugin: ``kernel_backend``)."""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel

pytest_plugins = ["mindspeed_like.testing.pytest_plugin"]


@pytest.fixture
def adapter():
    """megatron-core on CPU through the adaptor, with fresh parallel state; undone afterwards."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel()
    yield
    destroy_parallel()
    mindspeed_like.reset()


@pytest.fixture
def cpu_config():
    """``cpu_config(**flags)``: reset, then configure the CPU device with ``flags``; the test
    builds its own parallel state. Parallel state and config are undone afterwards."""

    def setup(**flags):
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu", **flags)

    yield setup
    destroy_parallel()
    mindspeed_like.reset()


# Parametrized variants that run only in the slow lane (`make test-all`): each is a multi-process
# or long run whose behaviour a sibling variant in the default lane already exercises (named
# after the arrow). Whole slow functions carry `@pytest.mark.slow` in their files instead.
SLOW_VARIANTS = {
    # distopt resume: dp_reshardable-pa-bf16 stays (the precision-aware fix of issue 28)
    "tests/reliability/test_distopt_checkpoint_resume.py::test_train_save_resume_equals_straight_bitwise[legacy-plain]",
    "tests/reliability/test_distopt_checkpoint_resume.py::test_train_save_resume_equals_straight_bitwise"
    "[fully_sharded_model_space-reuse]",
    # CP=2 GPT: megatron_cp_algo stays
    "tests/features/context_parallel/test_context_parallel_gpt.py::test_cp2_equals_cp1[kvallgather_cp_algo]",
    # CP kernels: the ring variants stay
    "tests/kernels/test_context_parallel_kernels.py::test_hybrid_cp4_matches_one_rank_float64[u2-causal]",
    "tests/kernels/test_context_parallel_kernels.py::test_fp32_matches_one_rank_float64[2-True-4-2-13-allgather_kv]",
    "tests/kernels/test_context_parallel_kernels.py::test_fp32_matches_one_rank_float64[2-True-4-2-13-ulysses]",
    "tests/kernels/test_context_parallel_kernels.py::test_npu_backend_matches_one_rank_float64[ulysses-2-True-4-2-13]",
    "tests/kernels/test_context_parallel_kernels.py::test_npu_backend_bf16_within_stated_tolerance[ring]",
    "tests/features/context_parallel/test_context_parallel_v_head_dim.py::"
    "test_fp32_v_head_dim_differs_matches_one_rank_float64[allgather_kv-True-portable]",
    "tests/features/context_parallel/test_context_parallel_v_head_dim.py::"
    "test_fp32_v_head_dim_differs_matches_one_rank_float64[ring-True-npu]",
    "tests/features/context_parallel/test_context_parallel_v_head_dim.py::"
    "test_fp32_v_head_dim_differs_matches_one_rank_float64[ulysses-True-portable]",
    "tests/kernels/test_context_parallel_kernels.py::test_dropout_backward_is_the_derivative_and_forward_is_unbiased"
    "[ring-2-True]",
    "tests/kernels/test_context_parallel_kernels.py::test_mqa_one_key_value_group[ring]",
    "tests/kernels/test_context_parallel_kernels.py::test_bf16_within_stated_tolerance[ring]",
    # three fused kernels together: fp32 stays
    "tests/integration/test_fused_kernels_together.py::test_all_three_fused_kernels_match_megatron[bf16]",
    # fused linear cross-entropy: untied fp32 GPT and the TP=2 unit kernels stay
    "tests/features/fused_linear_cross_entropy/test_fused_linear_cross_entropy.py::test_tp2_parity[sp-untied]",
    "tests/features/fused_linear_cross_entropy/test_fused_linear_cross_entropy.py::test_gpt_parity_fp32[tied]",
    # grouped GEMM: the fusion's single-process tests and the allgather dispatcher stay
    "tests/features/grouped_gemm/test_grouped_gemm.py::test_gemm_gradient_accumulation_fusion_parity[required]",
    "tests/features/grouped_gemm/test_grouped_gemm.py::test_gemm_gradient_accumulation_fusion_parity[default]",
    "tests/features/grouped_gemm/test_grouped_gemm.py::test_gpt_trains_like_sequential_fp32[alltoall]",
    # te_shim import orders: client-first and megatron-first (the spec provider imported before the import line) stay
    "tests/te_shim/test_client_module.py::test_megatron_sees_no_te_in_any_import_order[adaptor-megatron-client]",
    # recompute-activation-function distributed: the DP case stays
    "tests/features/recompute_activation/test_recompute_activation_distributed.py::"
    "test_bitwise_equal_losses_with_and_without[tp2_sp]",
    # LLaVA with SP/CP on the te-backend's attention: TP 2 + SP stays
    "tests/te_backend/test_te_llava.py::"
    "test_llava_with_sequence_or_context_parallelism_builds_on_the_backends_attention[cp2]",
    # Megatron-FSDP optim with overlapped reduction: without fix-megatron-fsdp-unsharded-grads stays
    "tests/fsdp/test_fsdp_parallel_layouts.py::"
    "test_megatron_fsdp_optim_with_overlapped_reduction_trains_as_the_distributed_optimizer"
    "[fix-megatron-fsdp-hsdp-grad-reduce]",
}
VERSION_PARAMETRIZED = {"tests/reliability/test_distopt_checkpoint_resume.py"}
"""Files whose parameters follow the installed megatron-core (checkpoint formats by release)."""


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    known = set()
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
            known.add(item.nodeid)
    # a renamed test must not drift silently: a listed variant whose file was collected must exist
    # (unless its parametrization depends on the installed megatron-core, as the resume formats do)
    collected_files = {item.nodeid.split("::")[0] for item in items}
    missing = {
        nodeid
        for nodeid in SLOW_VARIANTS - known
        if nodeid.split("::")[0] in collected_files and nodeid.split("::")[0] not in VERSION_PARAMETRIZED
    }
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS names tests that do not exist: {sorted(missing)}")
