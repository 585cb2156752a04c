"""Every fused kernel the accelerations call, forward and backward, on the lane's device against
float64.

The device run uses the backend the tensor's device picks (``kernels.backend.backend_for``: what a
user's model gets there, the compiled kernels included when TorchDynamo is on; in the CPU self-check
the backend CUDA tensors get, forced: ``cuda_lane.as_on_cuda``); the oracle is the
same op on the CPU in float64 under ``force_backend("reference")``, the plain eager math that the
CPU lane's kernel tests prove against their own float64 formulas (the linear cross-entropy, which
has no reference backend, against ``F.cross_entropy`` in float64). Inputs are drawn on the CPU from
a seeded generator, rounded to the tested dtype, and the same values go to both. Bounds: the
project's table (``testing.parity.TOLERANCES``: fp32 1e-5, bf16 2e-2 of the reference's largest
magnitude, per tensor); none is CUDA-specific: TF32 is off in the lane, so a CUDA GEMM or SDPA
kernel rounds like any fp32/bf16 kernel.

Shapes: the tiny GPT's (hidden 64, 4 heads of 16, ffn 128, 64 tokens), where the compiled kernels
then share graphs with the parity runs, plus one odd size per op (the generated code's masking).

Not here: reuse-fp32-param's and the precision-aware optimizer's kernels (their optimizer steps),
covered bitwise / within their bounds by the GPT parity cases through megatron's optimizer; the
context-parallel algorithms' communication and tp-overlap's tiles (several ranks:
cuda_lane.NOT_ON_ONE_GPU); context-parallel's block attention and merge run here at one rank.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from cuda_lane import DEVICE_ENV, DTYPES, MEASURED, as_on_cuda

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.flash_attention import CAUSAL, Band, flash_attention
from mindspeed_like.kernels.grouped_gemm import gmm
from mindspeed_like.kernels.linear_cross_entropy import linear_cross_entropy
from mindspeed_like.kernels.moe_permute import permute, unpermute
from mindspeed_like.kernels.moe_router import topk_routing
from mindspeed_like.kernels.rmsnorm import rms_norm
from mindspeed_like.kernels.rope import apply_rope
from mindspeed_like.kernels.swiglu import swiglu, weighted_swiglu
from mindspeed_like.testing.parity import assert_close_to_reference, max_relative_error, tolerance

pytestmark = pytest.mark.cuda
BOTH = ["fp32", "bf16"]
_current: dict[str, str] = {}


@dataclass(frozen=True)
class Env:
    """Where an op runs: the lane's device (``oracle=False``) or the CPU in float64 (the oracle).
    ``constant``: the dtype of fp32 constants (angles, router probabilities): fp32 on the device,
    float64 in the oracle."""

    device: torch.device
    oracle: bool

    @property
    def constant(self) -> torch.dtype:
        return torch.float64 if self.oracle else torch.float32


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def check(
    lane_device: torch.device,
    dtype_name: str,
    fn: Callable[..., torch.Tensor],
    inputs: dict[str, torch.Tensor],
    *,
    what: str,
    fp32_inputs: tuple[str, ...] = (),
    floor: float = 0.0,
) -> torch.Tensor:
    """``fn(env, **inputs)`` forward and backward on the device vs the float64 oracle.

    ``inputs`` (fp32, on the CPU) are rounded to the tested dtype (those in ``fp32_inputs`` stay fp32,
    as megatron keeps them) and require grad; the output's gradient is a seeded random tensor. Every
    output and input gradient is held to the dtype's bound. Returns the device output (on the CPU)."""
    dtype = DTYPES[dtype_name]
    rounded = {k: v.to(torch.float32 if k in fp32_inputs else dtype) for k, v in inputs.items()}
    leaves = {k: v.to(lane_device, copy=True).requires_grad_() for k, v in rounded.items()}
    with as_on_cuda(lane_device):
        out = fn(Env(lane_device, oracle=False), **leaves)
        grad = torch.randn(out.shape, generator=_gen(what, "grad"))
        out.backward(grad.to(lane_device, out.dtype))
    with force_backend("reference"):
        leaves64 = {k: v.double().requires_grad_() for k, v in rounded.items()}
        ref = fn(Env(torch.device("cpu"), oracle=True), **leaves64)
        ref.backward(grad.double())
    assert out.device.type == lane_device.type, f"{what}: output on {out.device}, inputs on {lane_device}"
    pairs = {"out": (out.detach().cpu(), ref)}
    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"{what}: no gradient reached {name}"
        pairs[f"d{name}"] = (leaf.grad.cpu(), leaves64[name].grad)
    errors = MEASURED.setdefault(_current["test"], {}).setdefault("max_rel_error", {})
    for name, (actual, expected) in pairs.items():  # every error recorded before any is judged
        errors[name] = max_relative_error(actual, expected, floor)
    errors["bound"] = tolerance(dtype).rtol
    for name, (actual, expected) in pairs.items():
        assert_close_to_reference(actual, expected, dtype, what=f"{what}: {name}", floor=floor)
    return out.detach().cpu()


@pytest.fixture(autouse=True)
def _current_test(request):
    """The running test's id, under which ``check`` records the errors it measured (the lane's record)."""
    _current["test"] = request.node.name
    yield


# ---------------------------------------------------------------- fused-rmsnorm


@pytest.mark.parametrize(
    "dtype,shape,zero_centered",
    [
        ("fp32", (32, 2, 64), False),
        ("bf16", (32, 2, 64), False),
        ("fp32", (7, 129), False),
        ("fp32", (32, 2, 64), True),
    ],
)
def test_rmsnorm(lane_device, dtype, shape, zero_centered):
    g = _gen("rmsnorm", dtype, shape, zero_centered)
    x = torch.randn(shape, generator=g)
    w = torch.rand(shape[-1], generator=g) * 0.2 + (0.0 if zero_centered else 0.9)
    check(
        lane_device,
        dtype,
        lambda env, x, w: rms_norm(x, w, 1e-5, zero_centered),
        dict(x=x, w=w),
        what=f"rmsnorm {dtype} {shape} zero_centered={zero_centered}",
    )


# ---------------------------------------------------------------- fused-swiglu


@pytest.mark.parametrize(
    "dtype,shape", [("fp32", (32, 2, 256)), ("bf16", (32, 2, 256)), ("fp32", (7, 258))], ids=["fp32", "bf16", "odd"]
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_swiglu(lane_device, dtype, shape, with_bias):
    g = _gen("swiglu", dtype, shape, with_bias)
    inputs = dict(x=torch.randn(shape, generator=g))
    if with_bias:
        inputs["bias"] = torch.randn(shape[-1], generator=g)
    check(lane_device, dtype, lambda env, **t: swiglu(t["x"], t.get("bias")), inputs, what=f"swiglu {dtype} {shape}")


@pytest.mark.parametrize("dtype", BOTH)
def test_weighted_swiglu(lane_device, dtype):
    """MoE experts' SwiGLU times the routing probability (fp32 probs, as megatron passes them)."""
    g = _gen("weighted_swiglu", dtype)
    inputs = dict(x=torch.randn(64, 256, generator=g), w=torch.rand(64, 1, generator=g))
    check(
        lane_device,
        dtype,
        lambda env, x, w: weighted_swiglu(x, w),
        inputs,
        what=f"weighted swiglu {dtype}",
        fp32_inputs=("w",),
    )


# ---------------------------------------------------------------- fused-rotary-pos-emb


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])  # partial rotation: the compiled kernel
def test_rope(lane_device, dtype, mode, rot_dim):
    g = _gen("rope", dtype, mode, rot_dim)
    t = torch.randn(32, 2, 4, 16, generator=g)
    angles = torch.rand(32, 1, 1, rot_dim, generator=g) * 10

    def fn(env, t):
        return apply_rope(t, angles.to(env.device, env.constant), mode=mode)

    check(lane_device, dtype, fn, dict(t=t), what=f"rope {mode} rot_dim={rot_dim} {dtype}")


# ---------------------------------------------------------------- flash-attention


ATTENTION = {
    "causal-gqa": dict(kv_heads=2, dv=16, band=CAUSAL, mask=False, packed=False),
    "window": dict(kv_heads=2, dv=16, band=Band(8, 0), mask=False, packed=False),
    "padding-mask": dict(kv_heads=4, dv=16, band=CAUSAL, mask=True, packed=False),
    "mla-value-dim": dict(kv_heads=2, dv=8, band=CAUSAL, mask=False, packed=False),
    "packed": dict(kv_heads=2, dv=16, band=CAUSAL, mask=False, packed=True),
}


@pytest.mark.parametrize(
    "dtype,case",
    [("fp32", "causal-gqa"), ("bf16", "causal-gqa"), ("fp32", "window"), ("fp32", "padding-mask"),
     ("fp32", "mla-value-dim"), ("bf16", "mla-value-dim"), ("fp32", "packed")],
)  # fmt: skip
def test_flash_attention(lane_device, dtype, case):
    spec = ATTENTION[case]
    s, b, heads, d = 32, 2, 4, 16
    g = _gen("attention", dtype, case)
    if spec["packed"]:  # two sequences of 12 and 20 tokens in one [t, n, d] batch
        shapes = ((s, heads, d), (s, spec["kv_heads"], d), (s, spec["kv_heads"], spec["dv"]))
    else:
        shapes = ((s, b, heads, d), (s, b, spec["kv_heads"], d), (s, b, spec["kv_heads"], spec["dv"]))
    inputs = {name: torch.randn(shape, generator=g) for name, shape in zip("qkv", shapes)}
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[1, ..., -5:] = True  # the second sequence's last 5 keys are padding

    def fn(env, q, k, v):
        extra = {}
        if spec["packed"]:
            extra = dict(cu_seqlens_q=torch.tensor([0, 12, s], dtype=torch.int32, device=env.device))
        if spec["mask"]:
            extra["mask"] = mask.to(env.device)
        return flash_attention(q, k, v, scale=d**-0.5, band=spec["band"], **extra)

    check(lane_device, dtype, fn, inputs, what=f"flash attention {case} {dtype}")


# ---------------------------------------------------------------- context-parallel (one rank)


@pytest.mark.parametrize("dtype,dv", [("fp32", 16), ("bf16", 16), ("fp32", 8)], ids=["fp32", "bf16", "mla-value-dim"])
def test_context_parallel_blocks_at_one_rank(lane_device, dtype, dv):
    """The all-gather algorithm at CP = 1: query chunk 1 attends chunk 0 unmasked and itself causally,
    two blocks merged by their log-sum-exp (forward and the blocks' backward against the merged
    statistics: the CP attention math that runs on each rank); the communication needs two ranks."""
    import torch.distributed as dist

    from mindspeed_like.kernels.context_parallel import CPGroup, allgather_kv_attention

    b, heads, groups, s, d = 2, 4, 2, 32, 16
    g = _gen("cp", dtype, dv)
    inputs = dict(
        q=torch.randn(b, heads, s, d, generator=g),
        k=torch.randn(b, groups, s, d, generator=g),
        v=torch.randn(b, groups, s, dv, generator=g),
    )

    def fn(env, q, k, v):
        if env.oracle:  # megatron's eager attention in float64 (flash_attention's reference, [s, b, n, d])
            sbhd = [t.permute(2, 0, 1, 3) for t in (q, k, v)]
            return flash_attention(*sbhd, scale=d**-0.5, band=CAUSAL).view(s, b, heads, dv).permute(1, 2, 0, 3)
        return allgather_kv_attention(q, k, v, CPGroup(dist.group.WORLD, (0,)), causal=True, scale=d**-0.5)

    check(lane_device, dtype, fn, inputs, what=f"context-parallel blocks {dtype} dv={dv}")


# ---------------------------------------------------------------- grouped-gemm


@pytest.mark.parametrize(
    "dtype,k,n,trans_b",
    [("fp32", 64, 48, False), ("bf16", 64, 48, False), ("fp32", 64, 48, True), ("bf16", 64, 48, True),
     ("fp32", 36, 18, False)],  # 18 fp32 columns: rows not 16-byte aligned, the per-expert loop
)  # fmt: skip
def test_grouped_gemm(lane_device, dtype, k, n, trans_b):
    counts = [5, 0, 12, 7]  # an expert without tokens included
    g = _gen("gmm", dtype, k, n, trans_b)
    a = torch.randn(sum(counts), k, generator=g)
    b = torch.randn(len(counts), *((n, k) if trans_b else (k, n)), generator=g) / 8

    def fn(env, a, b):
        return gmm(a, b, torch.tensor(counts), trans_b)  # megatron passes the counts as a CPU tensor

    check(lane_device, dtype, fn, dict(a=a, b=b), what=f"gmm {dtype} k={k} n={n} trans_b={trans_b}")


# ---------------------------------------------------------------- moe-permute


@pytest.mark.parametrize("dtype,drop_and_pad", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_moe_permute_and_unpermute(lane_device, dtype, drop_and_pad):
    tokens, experts, topk, capacity = 16, 4, 2, 6
    g = _gen("permute", dtype, drop_and_pad)
    logits = torch.randn(tokens, experts, generator=g)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, logits.topk(topk, dim=1).indices, True)
    out_tokens = experts * capacity if drop_and_pad else tokens * topk
    ramp = torch.linspace(0.5, 1.5, out_tokens).unsqueeze(1)  # row-dependent: a wrong order shows

    def fn(env, x, probs):
        kept = routing_map.to(env.device)
        permuted, _, indices = permute(
            x, kept, probs, num_out_tokens=out_tokens if drop_and_pad else None, drop_and_pad=drop_and_pad
        )
        assert permuted.shape[0] == out_tokens
        scaled = permuted * ramp.to(env.device, permuted.dtype)
        return unpermute(scaled, indices, x.shape, probs=probs, routing_map=kept, drop_and_pad=drop_and_pad)

    inputs = dict(x=torch.randn(tokens, 64, generator=g), probs=torch.softmax(logits, dim=1))
    check(lane_device, dtype, fn, inputs, what=f"permute/unpermute {dtype} drop_and_pad={drop_and_pad}")


# ---------------------------------------------------------------- moe-router


ROUTERS = {
    "softmax-top2": dict(topk=2),
    "deepseek-sigmoid": dict(topk=2, num_groups=4, group_topk=2, scaling_factor=2.5, score_function="sigmoid"),
}


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_moe_router(lane_device, dtype, router):
    """Logits are distinct multiples of 1/4 per token (exact in bf16, no ties), so the choice of
    experts is the oracle's and the probabilities can be compared."""
    tokens, experts = 16, 8
    g = _gen("router", dtype, router)
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).float() * 0.25 - 1.0
    args = dict(ROUTERS[router])
    bias = torch.arange(experts).float() * 1e-3 if args.get("score_function") == "sigmoid" else None
    maps = {}

    def fn(env, logits):
        expert_bias = None if bias is None else bias.to(env.device, env.constant)
        probs, routing_map = topk_routing(logits, expert_bias=expert_bias, **args)
        maps[env.oracle] = routing_map.cpu()
        return probs

    check(lane_device, dtype, fn, dict(logits=logits), what=f"router {router} {dtype}")
    assert torch.equal(maps[False], maps[True]), "the experts chosen differ from the oracle's"


# ---------------------------------------------------------------- fused-linear-cross-entropy


@pytest.mark.parametrize("dtype", BOTH)
def test_linear_cross_entropy(lane_device, dtype):
    """The output layer and the loss in chunks of 16 tokens (4 chunks; the backward in vocab slices)."""
    g = _gen("lce", dtype)
    labels = torch.randint(0, 256, (32, 2), generator=g)

    def fn(env, hidden, weight):
        if env.oracle:  # no reference backend: the unfused math in float64
            logits = hidden @ weight.t()
            return F.cross_entropy(logits.view(-1, 256), labels.view(-1), reduction="none").view(labels.shape)
        return linear_cross_entropy(hidden, weight, labels.to(env.device), chunk_tokens=16)

    inputs = dict(hidden=torch.randn(32, 2, 64, generator=g), weight=torch.randn(256, 64, generator=g) / 8)
    check(lane_device, dtype, fn, inputs, what=f"linear cross-entropy {dtype}")


# ---------------------------------------------------------------- the compiled kernels compiled


def test_each_kernel_takes_its_device_path(lane_device):
    """With TorchDynamo on (how users run, and how the GPU lane runs) each portable op takes the path
    meant for this device, checked because a fallback (said once) would still pass the parity:

    - SwiGLU: the cuda backend's Triton kernels where their once-per-device check passed (on a GPU;
      in the CPU self-check outside Triton's interpreter that check fails and the compiled op runs);
    - RMSNorm: the cuda backend is torch's own fused kernel (F.rms_norm), never the compiled op;
    - partial RoPE: the compiled kernels (no CUDA-specific RoPE)."""
    from mindspeed_like.kernels.backends import cuda_swiglu

    dynamo_off = os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0") or torch._dynamo.config.disable
    if dynamo_off:
        if os.environ.get(DEVICE_ENV) == "cuda":  # the lane asked for by name (`make test-cuda`, the GPU command)
            pytest.fail("the CUDA lane runs with torch.compile on: set TORCHDYNAMO_DISABLE=0 (`make test-cuda` does)")
        pytest.skip("TORCHDYNAMO_DISABLE is set: the compiled kernels run eagerly in this run")
    why = compiled.unavailable(lane_device)
    assert why is None, f"compiled kernels unavailable on {lane_device.type}: {why}"
    triton_swiglu = cuda_swiglu.failed_check(lane_device) is None
    if lane_device.type == "cuda":
        assert triton_swiglu, f"the Triton SwiGLU did not pass its check on {lane_device}"
    before = dict(compiled._compiled)
    with as_on_cuda(lane_device):
        x = torch.randn(64, 256, device=lane_device, requires_grad=True)
        out = swiglu(x)
        out.sum().backward()
        y = torch.randn(64, 64, device=lane_device, requires_grad=True)
        rms_norm(y, torch.ones(64, device=lane_device, requires_grad=True)).sum().backward()
        t = torch.randn(32, 2, 4, 16, device=lane_device, requires_grad=True)
        apply_rope(t, torch.rand(32, 1, 1, 8, device=lane_device)).sum().backward()
    assert ("TritonSwiGLU" in type(out.grad_fn).__name__) == triton_swiglu, type(out.grad_fn).__name__
    for name in ("rms_norm", "rms_norm_backward"):
        assert compiled._compiled.get(name) is before.get(name), f"{name} took the compiled op under the cuda backend"
    compiled_names = ("rope", "rope_backward") + (() if triton_swiglu else ("swiglu", "swiglu_backward"))
    for name in compiled_names:
        body = compiled._compiled.get(name)
        assert body is not None and body is not getattr(compiled, f"{name}_math"), (
            f"{name} ran eagerly on {lane_device.type} (compiling it failed: see the log's 'compiling {name} failed')"
        )
