"""Worker bodies for tests/test_tp_overlap.py: each runs in every rank of one gloo spawn and
returns plain data (errors, counts, timelines) that the test asserts on.

The layer comparison follows one recipe: build megatron's ColumnParallelLinear /
RowParallelLinear, run forward + backward unpatched, switch the feature on with
``configure`` and run again on the same layer object with identical inputs, then compare
output, input grad, weight grad and bias grad (max abs error over max abs reference).
"""

from __future__ import annotations

import logging

import torch

import mindspeed_like
from mindspeed_like.testing.parity import SEED


def _setup(tp: int, **flags) -> None:
    from mindspeed_like.testing import init_parallel

    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", **flags)
    init_parallel(tp=tp, seed=SEED)


def _parallel_config(sequence_parallel: bool, dtype: torch.dtype, tp: int):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )


def build_layer(
    kind: str,
    sequence_parallel: bool,
    dtype: torch.dtype,
    tp: int,
    hidden: int,
    ffn: int,
    bias: bool,
    skip_bias_add: bool = False,
):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(SEED)
    config = _parallel_config(sequence_parallel, dtype, tp)
    init = torch.nn.init.normal_
    if kind == "column":
        return ColumnParallelLinear(
            hidden, ffn, config=config, init_method=init, bias=bias, gather_output=False, skip_bias_add=skip_bias_add
        )
    return RowParallelLinear(
        ffn, hidden, config=config, init_method=init, bias=bias, input_is_parallel=True, skip_bias_add=skip_bias_add
    )


def _inputs(layer, kind: str, seq: int, batch: int, dtype: torch.dtype, tp: int, rank: int):
    gen = torch.Generator().manual_seed(SEED + 17 * rank + seq)
    sp = layer.sequence_parallel
    if kind == "column":
        rows = seq // tp if sp else seq
        x = torch.randn(rows, batch, layer.input_size, generator=gen)
        out_rows, out_dim = seq, layer.output_size_per_partition
    else:
        x = torch.randn(seq, batch, layer.input_size_per_partition, generator=gen)
        out_rows, out_dim = (seq // tp if sp else seq), layer.output_size
    if not sp and kind == "column":  # replicated input/grad without SP: the same on every rank
        gen = torch.Generator().manual_seed(SEED + seq)
        x = torch.randn(rows, batch, layer.input_size, generator=gen)
    if not sp and kind == "row":
        gen_g = torch.Generator().manual_seed(SEED + 999 + seq)
    else:
        gen_g = torch.Generator().manual_seed(SEED + 999 + 17 * rank + seq)
    grad = torch.randn(out_rows, batch, out_dim, generator=gen_g)
    return x.to(dtype), grad.to(dtype)


def _run(layer, x, grad):
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out, out_bias = layer(x)
    total = out if out_bias is None else out + out_bias
    total.backward(grad)
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return {"out": out.detach().clone(), "dx": x.grad.detach().clone(), **grads}, type(out.grad_fn).__name__


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare_case(
    tp: int,
    kind: str,
    sp: bool,
    tiles: int,
    seq: int,
    batch: int,
    dtype=torch.float32,
    bias=False,
    skip_bias_add=False,
    hidden=32,
    ffn=48,
    mc2=False,
    fresh_groups=True,
) -> dict:
    """Errors of the patched layer vs megatron's on identical weights and inputs, and which
    autograd Function produced the patched output (proves the route)."""
    import torch.distributed as dist

    if fresh_groups:
        _setup(tp)
    layer = build_layer(kind, sp, dtype, tp, hidden, ffn, bias, skip_bias_add)
    x, grad = _inputs(layer, kind, seq, batch, dtype, tp, dist.get_rank())
    base, base_fn = _run(layer, x, grad)
    if mc2:
        mindspeed_like.configure(use_fused_tp_comm_matmul=True)
    else:
        mindspeed_like.configure(use_tiled_tp_overlap=True, tiled_tp_overlap_chunks=tiles)
    from mindspeed_like.testing.tp_timeline import record_timeline

    with record_timeline() as events:
        ours, our_fn = _run(layer, x, grad)
    mindspeed_like.configure(use_tiled_tp_overlap=False, use_fused_tp_comm_matmul=False)
    again, _ = _run(layer, x, grad)  # switched off: megatron's path again, bitwise
    errors = {key: _rel(ours[key], base[key]) for key in base}
    restored = all(torch.equal(again[key], base[key]) for key in base)
    tiled_matmuls = sum(1 for event in events if event[0] == "mm_start")
    return {"errors": errors, "fn": our_fn, "base_fn": base_fn, "restored": restored, "tiled_matmuls": tiled_matmuls}


CASES_TP2 = [
    # (kind, sp, tiles, seq, batch, extra)
    ("column", True, 2, 16, 2, {}),
    ("column", True, 4, 16, 2, {"bias": True}),
    ("column", True, 8, 16, 2, {}),
    ("column", True, 4, 14, 1, {}),  # ragged: 7 local rows in 4 tiles
    ("column", True, 8, 6, 3, {}),  # ragged: 9 local rows in 8 tiles
    ("column", False, 4, 10, 3, {"bias": True}),  # all-reduce of dgrad
    ("row", True, 2, 16, 2, {}),
    ("row", True, 4, 16, 2, {"bias": True}),
    ("row", True, 8, 16, 2, {"bias": True, "skip_bias_add": True}),
    ("row", True, 4, 10, 1, {}),  # ragged: 5 local rows in 4 tiles
    ("row", False, 4, 9, 2, {"bias": True}),  # all-reduce
    ("column", True, 4, 16, 2, {"dtype": torch.bfloat16}),
    ("row", True, 4, 16, 2, {"dtype": torch.bfloat16, "bias": True}),
]

CASES_TP4 = [
    ("column", True, 2, 16, 2, {}),
    ("column", True, 4, 16, 2, {"bias": True}),
    ("column", True, 8, 32, 2, {}),
    ("column", True, 4, 12, 1, {}),  # ragged: 3 local rows < 4 tiles -> fallback
    ("column", True, 2, 12, 1, {}),  # ragged: 3 local rows in 2 tiles
    ("column", False, 8, 10, 1, {}),
    ("row", True, 2, 16, 2, {"bias": True}),
    ("row", True, 4, 20, 1, {}),  # ragged: 5 local rows in 4 tiles
    ("row", True, 8, 32, 2, {}),
    ("row", False, 4, 6, 1, {}),
    ("row", True, 4, 16, 2, {"dtype": torch.bfloat16}),
]


def layer_cases_worker(tp: int, cases: list) -> list:
    results = []
    for kind, sp, tiles, seq, batch, extra in cases:
        results.append(compare_case(tp, kind, sp, tiles, seq, batch, **extra))
    mindspeed_like.reset()
    return results


def fallback_worker(tp: int) -> dict:
    """Too few token rows for the tiles: megatron's Function runs and one log line says why;
    under strict it is an error. Tiles=1: megatron's path, logged."""
    from mindspeed_like.features import tp_overlap
    from mindspeed_like.toolkit.fallback import forget_logged

    records: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("mindspeed_like")
    logger.addHandler(handler)
    forget_logged()
    try:
        few = compare_case(tp, "column", True, 8, 2 * tp, 2)  # 4 local rows < 8 tiles
        # the same reason in the same session (no reset between): not logged twice
        few_again = compare_case(tp, "column", True, 8, 2 * tp, 2, fresh_groups=False)
        one = compare_case(tp, "row", True, 1, 16, 2)
        _setup(tp, use_tiled_tp_overlap=True, tiled_tp_overlap_chunks=8, strict=True)
        layer = build_layer("column", True, torch.float32, tp, 32, 48, False)
        strict_error = ""
        try:
            layer(torch.randn(2, 2, 32))
        except tp_overlap.TpOverlapUnsupported as error:
            strict_error = str(error)
    finally:
        logger.removeHandler(handler)
        mindspeed_like.reset()
    return {"few": few, "few_again": few_again, "one": one, "records": records, "strict_error": strict_error}


def timeline_worker(tp: int, tiles: int) -> dict:
    """The order of collective issue/wait and matmul start/end in each of the four passes."""
    import torch.distributed as dist

    from mindspeed_like.testing.tp_timeline import record_timeline

    out = {}
    for kind in ("column", "row"):
        _setup(tp, use_tiled_tp_overlap=True, tiled_tp_overlap_chunks=tiles)
        layer = build_layer(kind, True, torch.float32, tp, 32, 48, False)
        x, grad = _inputs(layer, kind, 16, 2, torch.float32, tp, dist.get_rank())
        x.requires_grad_(True)
        with record_timeline() as forward:
            y, _ = layer(x)
        with record_timeline() as backward:
            y.backward(grad)
        out[kind] = {"forward": forward, "backward": backward}
    mindspeed_like.reset()
    return out


def fusion_and_deferral_worker(tp: int) -> dict:
    """gradient_accumulation_fusion into main_grad and wgrad deferral, on the Function directly
    (megatron's own fused path needs apex's CUDA kernel, so the reference is the plain math)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mindspeed_like.kernels.tp_overlap.column import column_parallel_tiled
    from mindspeed_like.kernels.tp_overlap.row import row_parallel_tiled

    _setup(tp)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn(6, 2, 16, generator=gen)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=gen))
    grad = torch.randn(6 * tp, 2, 24, generator=gen)
    out = {}
    # reference weight grad (no fusion): plain autograd result of the Function
    y = column_parallel_tiled(x, weight, None, False, False, True, None, 0, group, 4)
    y.backward(grad)
    plain = weight.grad.clone()
    weight.grad = None
    weight.main_grad = torch.full_like(weight, 0.5)
    weight.grad_added_to_main_grad = False
    y = column_parallel_tiled(x, weight, None, True, False, True, None, 0, group, 4)
    y.backward(grad)
    out["main_grad_err"] = _rel(weight.main_grad - 0.5, plain)
    out["grad_added"] = bool(weight.grad_added_to_main_grad)
    out["dummy_grad_shape"] = tuple(weight.grad.shape)
    # deferral: grad_output appended, weight grad skipped while under the limit
    buffer: list = []
    weight.grad = None
    del weight.main_grad, weight.grad_added_to_main_grad
    y = column_parallel_tiled(x, weight, None, False, False, True, buffer, 2, group, 4)
    y.backward(grad)
    out["deferred"] = (len(buffer), weight.grad is None, torch.equal(buffer[0], grad))
    # row with fusion
    xr = torch.randn(4 * tp, 2, 16, generator=gen)
    w_row = torch.nn.Parameter(torch.randn(24, 16, generator=gen))
    g_row = torch.randn(4, 2, 24, generator=gen)
    row_parallel_tiled(xr, w_row, False, True, group, 2).backward(g_row)
    plain_row = w_row.grad.clone()
    w_row.grad = None
    w_row.main_grad = torch.zeros_like(w_row)
    row_parallel_tiled(xr, w_row, True, True, group, 2).backward(g_row)
    out["row_main_grad_err"] = _rel(w_row.main_grad, plain_row)
    out["row_grad_none"] = w_row.grad is None  # no grad_added_to_main_grad attribute: megatron returns None
    mindspeed_like.reset()
    return out


def gpt_parity_worker(tp: int, steps: int, tiles: int, bf16: bool = False) -> dict:
    """Training losses of the tiny GPT with TP + SP, without and with the feature."""
    from mindspeed_like.testing import destroy_parallel, tiny_gpt, train_steps

    losses = {}
    for on in (False, True):
        _setup(tp, use_tiled_tp_overlap=on, tiled_tp_overlap_chunks=tiles)
        losses[on] = train_steps(tiny_gpt(sequence_parallel=True, bf16=bf16), steps, seed=SEED)
        destroy_parallel()
    mindspeed_like.reset()
    return losses


def mc2_worker(tp: int) -> dict:
    """MC2 through the contract-checking emulator (real gloo collectives) vs megatron's layers."""
    from mindspeed_like.kernels.backend import force_backend
    from mindspeed_like.testing.npu_emulator import emulated_torch_npu

    out = {}
    with emulated_torch_npu() as npu, force_backend("npu"):
        for kind in ("column", "row"):  # one TP group for both: all MC2 ops share one communicator
            out[kind] = compare_case(
                tp,
                kind,
                True,
                4,
                8 * tp,
                2,
                dtype=torch.bfloat16,
                bias=True,
                hidden=256,
                ffn=256 * tp,
                mc2=True,
                fresh_groups=kind == "column",
            )  # every k >= 256
        out["calls"] = dict(npu.calls)
        out["hcom"] = npu.__dict__.get("_mc2_hcom")
    mindspeed_like.reset()
    return out


def mc2_communicator_worker(tp: int) -> str:
    """Two MC2 calls on two different communicators under one emulator: a ContractError."""
    import torch.distributed as dist

    from mindspeed_like.kernels.backends.npu import hccl_comm_name
    from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu

    other = dist.new_group(list(range(tp)))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    w = torch.randn(256, 8, dtype=torch.bfloat16)
    with emulated_torch_npu() as npu:
        npu.npu_all_gather_base_mm(x, w, hccl_comm_name(dist.group.WORLD), tp)
        try:
            npu.npu_all_gather_base_mm(x, w, hccl_comm_name(other), tp)
        except ContractError as error:
            return str(error)
    return ""


def bundle_worker(tp: int, cases: list, mc2: bool) -> dict:
    """Everything one world size checks, in one spawn (each spawn re-imports megatron)."""
    out = {"cases": layer_cases_worker(tp, cases), "fallback": fallback_worker(tp)}
    out["timeline"] = {tiles: timeline_worker(tp, tiles) for tiles in (2, 4)}
    out["fusion"] = fusion_and_deferral_worker(tp)
    if mc2:
        out["mc2"] = mc2_worker(tp)
        out["mc2_communicator"] = mc2_communicator_worker(tp)
    return out
