"""Tiled TP comm/compute overlap (``--use-tiled-tp-overlap`` / ``--use-ascend-coc``) and MC2
(``--use-fused-tp-comm-matmul`` / ``--use-ascend-mc2``).

Layer parity is against megatron's own unpatched ColumnParallelLinear / RowParallelLinear on
identical weights and inputs (same process; the feature switched on with ``configure``).
Tolerances (max abs error / max abs reference):
- fp32: 1e-6. Each output row is the same dot products as megatron's (a tile is a row range,
  the reduction dimension is never split) and the collectives sum the same values in the
  same rank order, so results are bitwise equal in practice; ragged tiles change the GEMM's
  blocking, which measured ~2e-7 (one or two fp32 roundings).
- bf16: 1e-2 (about one bf16 rounding, 2^-8 = 3.9e-3, of O(1) values, twice); measured 0.
- GPT TP=2+SP, 10 steps: per-step losses within 1e-5 relative (fp32); measured bitwise.
The MC2 path runs through the torch_npu emulator, which performs the real collective on the
gloo group named by the communicator and enforces the kernels' contract.
"""

from __future__ import annotations

import pytest
import torch
import tp_overlap_workers as workers

import mindspeed_like
from mindspeed_like.kernels.tp_overlap.tiles import tile_bounds
from mindspeed_like.testing import megatron_lm, run_distributed
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import assert_losses_close
from mindspeed_like.testing.tp_timeline import position
from mindspeed_like.toolkit.errors import ConfigError

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def clean():
    mindspeed_like.reset()
    yield
    mindspeed_like.reset()


# ---------------------------------------------------------------- tiles, flags, patches (one process)


@pytest.mark.parametrize("rows,tiles", [(16, 4), (7, 4), (9, 8), (8, 8), (5, 2)])
def test_tile_bounds_cover_rows_evenly(rows, tiles):
    bounds = tile_bounds(rows, tiles)
    assert len(bounds) == tiles and bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_tile_bounds_refuses_more_tiles_than_rows():
    with pytest.raises(ValueError, match="3 rows into 4"):
        tile_bounds(3, 4)


def test_mindspeed_spellings_and_primary_flags(clean):
    from mindspeed_like import runtime

    config = runtime.resolve_config(argv=["--use-ascend-coc", "--coc-parallel-num", "8", "--use-ascend-mc2"])
    assert config["use_tiled_tp_overlap"] and config["tiled_tp_overlap_chunks"] == 8
    assert config["use_fused_tp_comm_matmul"]
    config = runtime.resolve_config(argv=["--use-tiled-tp-overlap", "--tiled-tp-overlap-chunks", "2"])
    assert config["use_tiled_tp_overlap"] and config["tiled_tp_overlap_chunks"] == 2
    assert "tp-overlap" in runtime.enabled_feature_names(config)
    assert "tp-overlap" not in runtime.enabled_feature_names(runtime.resolve_config(argv=[]))


@pytest.mark.parametrize("bad", [3, 16, 0])
def test_tile_count_validated(clean, bad):
    with pytest.raises(ConfigError, match="tiled_tp_overlap_chunks"):
        mindspeed_like.configure(device="cpu", use_tiled_tp_overlap=True, tiled_tp_overlap_chunks=bad)


def test_mc2_without_npu_is_an_error_under_strict(clean):
    with pytest.raises(ConfigError, match="needs an Ascend NPU"):
        mindspeed_like.configure(device="cpu", use_fused_tp_comm_matmul=True, strict=True)


def test_flag_off_restores_megatron_objects(clean):
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.layers as layers

    mindspeed_like.configure(device="cpu")
    original_fn = layers.linear_with_grad_accumulation_and_async_allreduce
    original_forward = layers.RowParallelLinear.__dict__["forward"]
    assert tp_pkg.linear_with_grad_accumulation_and_async_allreduce is original_fn
    mindspeed_like.configure(use_tiled_tp_overlap=True)
    assert layers.linear_with_grad_accumulation_and_async_allreduce is not original_fn
    assert (
        tp_pkg.linear_with_grad_accumulation_and_async_allreduce
        is layers.linear_with_grad_accumulation_and_async_allreduce
    )
    assert layers.RowParallelLinear.__dict__["forward"] is not original_forward
    mindspeed_like.configure(use_tiled_tp_overlap=False)
    assert layers.linear_with_grad_accumulation_and_async_allreduce is original_fn
    assert tp_pkg.linear_with_grad_accumulation_and_async_allreduce is original_fn
    assert layers.RowParallelLinear.__dict__["forward"] is original_forward


def test_tp1_passes_through_untouched(adapter):
    """TP size 1: nothing communicates, megatron's Function runs, no log line."""
    mindspeed_like.configure(use_tiled_tp_overlap=True)
    layer = workers.build_layer("column", False, torch.float32, 1, 16, 24, False)
    out, _ = layer(torch.randn(8, 2, 16, requires_grad=True))
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"


# ---------------------------------------------------------------- MC2 emulator contract (one process)


@pytest.fixture
def world_group(adapter):
    import torch.distributed as dist

    return dist.group.WORLD


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "call",
    [
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 128), _bf16(128, 8), name, 2),  # k < 256
        lambda npu, name: npu.npu_all_gather_base_mm(torch.randn(4, 256), torch.randn(256, 8), name, 2),  # fp32
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(256, 8), "not-a-comm", 2),  # hcom
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(256, 8), name, 3),  # world size
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(256, 8), name, 2),  # != group size (1)
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(8, 256), name, 2),  # x2 not (k, n)
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(256, 4).t(), _bf16(256, 8), name, 2),  # not contiguous
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(256, 8), name, 2, None),  # positional
        lambda npu, name: npu.npu_all_gather_base_mm(_bf16(4, 256), _bf16(256, 8), name, 2, bias=_bf16(8)),
        lambda npu, name: npu.npu_mm_reduce_scatter_base(_bf16(4, 256), _bf16(256, 8), name, 2, comm_turn=1),
        lambda npu, name: npu.npu_mm_reduce_scatter_base(_bf16(4, 256), _bf16(256, 8), name, 2, reduce_op="max"),
        lambda npu, name: npu.npu_mm_reduce_scatter_base(_bf16(5, 256), _bf16(256, 8), name, 2),  # m % ws
        lambda npu, name: npu.npu_mm_reduce_scatter_base(_bf16(4, 256), _bf16(256, 8), name, 2, gather_output=True),
    ],
)
def test_mc2_emulator_rejects_wrong_calls(world_group, call):
    from mindspeed_like.kernels.backends.npu import hccl_comm_name

    with emulated_torch_npu(), pytest.raises(ContractError):
        from mindspeed_like.kernels.backends.npu import torch_npu

        call(torch_npu(), hccl_comm_name(world_group))


def test_mc2_unsupported_reasons(world_group):
    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.kernels.tp_overlap.mc2 import mc2_unsupported

    x, w = _bf16(4, 2, 256), _bf16(256, 256)
    assert "NPU" in mc2_unsupported(x, w, world_group, column=True)
    with force_backend("npu"):
        assert "tensor-parallel size 1" in mc2_unsupported(x, w, world_group, column=True)


# ---------------------------------------------------------------- TP=2 (one spawn) and TP=4 (slow)


def _local_rows(tp, kind, sp, seq, batch):
    if not sp:
        return seq * batch
    return (seq // tp) * batch if kind == "column" else seq * batch // tp


def _check_layer_cases(tp, cases, results):
    for (kind, sp, tiles, seq, batch, extra), result in zip(cases, results, strict=True):
        label = (kind, sp, tiles, seq, batch, extra)
        tol = TOL[extra.get("dtype", torch.float32)]
        for name, error in result["errors"].items():
            assert error <= tol, (label, name, error)
        assert result["restored"], label  # flag off again: megatron's path, bitwise
        if _local_rows(tp, kind, sp, seq, batch) >= tiles:
            # our tiles ran: one tiled matmul per tile in each pass that communicates
            # (column without SP: backward only; row without SP: forward only)
            expected = tiles * (2 if sp else 1)
            assert result["tiled_matmuls"] == expected, (label, result["tiled_matmuls"])
        else:
            assert result["tiled_matmuls"] == 0, label  # fell back to megatron


def _check_timeline(timeline, tiles):
    """Overlap, structurally. Communicate-first passes (column forward, row backward): tile
    i+1's all-gather is issued before tile i's matmul starts and waited after it ends.
    Compute-first passes (row forward, column backward): tile i's reduce-scatter is issued
    before tile i+1's matmul starts and waited after it ends."""
    first = [(timeline["column"]["forward"], "all_gather"), (timeline["row"]["backward"], "all_gather")]
    for events, kind in first:
        for i in range(tiles - 1):
            assert position(events, ("issue", kind, i + 1)) < position(events, ("mm_start", i)), events
            assert position(events, ("wait", kind, i + 1)) > position(events, ("mm_end", i)), events
    compute_first = [(timeline["row"]["forward"], "reduce_scatter"), (timeline["column"]["backward"], "reduce_scatter")]
    for events, kind in compute_first:
        for i in range(tiles - 1):
            assert position(events, ("issue", kind, i)) < position(events, ("mm_start", i + 1)), events
            assert position(events, ("wait", kind, i)) > position(events, ("mm_end", i + 1)), events
    # column backward: the input all-gather for the weight gradient is in flight under the dgrad tiles
    backward = timeline["column"]["backward"]
    assert position(backward, ("issue", "all_gather", 0)) < position(backward, ("mm_start", 0))
    assert position(backward, ("wait", "all_gather", 0)) > position(backward, ("mm_end", tiles - 1))


def _check_bundle(tp, cases, bundle, mc2):
    _check_layer_cases(tp, cases, bundle["cases"])
    fallback = bundle["fallback"]
    for key in ("few", "few_again", "one"):
        assert fallback[key]["tiled_matmuls"] == 0 and all(e == 0.0 for e in fallback[key]["errors"].values())
    few = [r for r in fallback["records"] if "token rows per rank" in r]
    assert len(few) == 1, fallback["records"]  # one line per reason, however many calls
    assert any("tiled_tp_overlap_chunks=1" in r for r in fallback["records"])
    assert "strict is on" in fallback["strict_error"]
    for tiles, timeline in bundle["timeline"].items():
        _check_timeline(timeline, tiles)
    fusion = bundle["fusion"]
    assert fusion["main_grad_err"] <= 1e-6 and fusion["row_main_grad_err"] <= 1e-6
    assert fusion["grad_added"] and fusion["row_grad_none"]
    assert fusion["deferred"] == (1, True, True)
    if mc2:
        result = bundle["mc2"]
        for kind in ("column", "row"):
            for name, error in result[kind]["errors"].items():
                assert error <= TOL[torch.bfloat16], (kind, name, error)
            assert result[kind]["restored"]
        # column: forward AG+mm, backward mm+RS; row: forward mm+RS, backward AG+mm
        assert result["calls"]["npu_all_gather_base_mm"] == 2 and result["calls"]["npu_mm_reduce_scatter_base"] == 2
        assert "differs" in bundle["mc2_communicator"]


@pytest.mark.slow
def test_tp2_layers_fallbacks_timeline_fusion_mc2():
    ranks = run_distributed(workers.bundle_worker, 2, 2, workers.CASES_TP2, True, timeout=400)
    for bundle in ranks:
        _check_bundle(2, workers.CASES_TP2, bundle, mc2=True)


@pytest.mark.slow
def test_tp4_layers_fallbacks_timeline_fusion_mc2():
    ranks = run_distributed(workers.bundle_worker, 4, 4, workers.CASES_TP4, True, timeout=900)
    for bundle in ranks:
        _check_bundle(4, workers.CASES_TP4, bundle, mc2=True)


def test_gpt_parity_tp2_sp_fp32():
    ranks = run_distributed(workers.gpt_parity_worker, 2, 2, 10, 4, timeout=600)
    for losses in ranks:
        assert len(losses[True]) == 10
        assert_losses_close(losses[True], losses[False], rtol=1e-5, what="tp-overlap on vs off")


# ---------------------------------------------------------------- Megatron-LM's command line (opt-in)


@pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)
def test_megatron_lm_command_line_switches_it_on():
    """pretrain_gpt.py TP=2 + SP with MindSpeed's spellings: the feature is on and the losses
    equal megatron's own path (the same math, tile by tile)."""
    _torchrun, _losses, _launcher = megatron_lm.torchrun, megatron_lm.losses, megatron_lm.launcher
    common = ["--use-cpu-initialization", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    reference = _torchrun(2, _launcher(), common)
    ours = _torchrun(2, _launcher(), [*common, "--use-ascend-coc", "--coc-parallel-num", "4"])
    assert "tp-overlap" in ours[0] and "tp-overlap" not in reference[0]
    assert _losses(ours) == pytest.approx(_losses(reference), rel=1e-5)


def test_gtp_sharded_weights_are_handed_back():
    """megatron-core 0.19's GTP rematerialization (``gtp_remat_size > 1``): the local weight is a
    shard that megatron all-gathers inside its own Function, so the tiled/MC2 kernels must not
    take it as the full matrix; the row-parallel check names it before anything else."""
    import types

    from mindspeed_like.features.tp_overlap.linears import GTP_REMAT, _row_unsupported

    layer = types.SimpleNamespace(gtp_remat_size=2, weight=torch.zeros(2, 2, requires_grad=True))
    assert _row_unsupported(layer, torch.zeros(4, 2)) == GTP_REMAT
    plain = types.SimpleNamespace(
        gtp_remat_size=1,
        weight=torch.zeros(2, 2, requires_grad=False),
    )
    assert _row_unsupported(plain, torch.zeros(4, 2)).startswith("frozen weight")
