"""PrecisionAwareAdam (kernels/adam.py) against torch's AdamW (bitwise, fp32 states) and a float64
Adam(W) per state dtype; remainders exact; TE's state API round trips; untouched params."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.kernels.adam import BLOCK, PrecisionAwareAdam, decode_blocks, encode_blocks
from mindspeed_like.testing.parity import SEED, assert_close_to_reference

FP8 = torch.uint8
SHAPES = [(64, 33), (1000,), (7,), (BLOCK,)]
STEPS, LR, BETAS, WD = 12, 1e-3, (0.9, 0.95), 0.1

# Bounds per state dtype, measured here at 4-15x below them (seed 1234, 12 steps):
# masters: max|w - w64| / (STEPS * LR), i.e. relative to the largest possible total update;
# fp32 masters themselves round at ulp(|w| ~ 4) / 2 = 2.4e-7 per step -> ~2e-4 of the update.
# moments: max|m - m64| / max|m64| (assert_close_to_reference).
BOUNDS = {
    torch.float32: dict(master=1e-3, moments=1e-6),  # only the fp32 rounding of each op
    torch.bfloat16: dict(master=2e-2, moments=2e-2),  # 2^-9 per rounding, compounded over steps
    torch.float16: dict(master=5e-3, moments=5e-3),  # 11-bit codes per 128-element block
    FP8: dict(master=0.15, moments=0.15),  # E4M3: 2^-4 relative per block (v in the sqrt domain)
}


def _grads(steps: int, seed: int = SEED) -> list[list[torch.Tensor]]:
    """Gradients spanning 3 decades per tensor, exactly bf16 (so bf16 and fp32 grads agree)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for s in SHAPES:
            scale = 10 ** (torch.rand(s, generator=gen) * -3)
            step.append((torch.randn(s, generator=gen) * scale).bfloat16().float())
        out.append(step)
    return out


def _weights(seed: int = SEED) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(s, generator=gen).bfloat16() for s in SHAPES]


def _adam64(ws, grads, *, adam_w_mode: bool = True):
    w = [x.double().clone() for x in ws]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, gs in enumerate(grads, 1):
        for i, g in enumerate(gs):
            g = g.double()
            if adam_w_mode:
                w[i] *= 1 - LR * WD
            else:
                g = g + WD * w[i]
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            w[i] -= LR * (m[i] / (1 - BETAS[0] ** t)) / ((v[i] / (1 - BETAS[1] ** t)).sqrt() + 1e-8)
    return w, m, v


def _run(dtype, *, remainders=True, master_dtype=torch.float32, adam_w_mode=True, grads=None, steps=STEPS):
    params = _weights()
    opt = PrecisionAwareAdam(
        params,
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        adam_w_mode=adam_w_mode,
        master_weights=True,
        master_weight_dtype=master_dtype,
        store_param_remainders=remainders,
        use_decoupled_grad=True,
        exp_avg_dtype=dtype,
        exp_avg_sq_dtype=dtype,
    )
    for gs in grads or _grads(steps):
        for p, g in zip(params, gs):
            p.decoupled_grad = g.bfloat16()  # megatron's bf16 main grads
        opt.step()
    return params, opt


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fp32_states_bitwise_equal_torch(adam_w_mode):
    """fp32 params, fp32 states, two groups (weight decay on/off): bit for bit torch's step."""
    gen = torch.Generator().manual_seed(SEED)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [x.clone().requires_grad_() for x in init]
    theirs = [x.clone().requires_grad_() for x in init]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": WD}, {"params": ps[2:], "weight_decay": 0.0}]

    a = PrecisionAwareAdam(groups(ours), lr=LR, betas=BETAS, adam_w_mode=adam_w_mode)
    b = cls(groups(theirs), lr=LR, betas=BETAS)
    for gs in _grads(6):
        for x, y, g in zip(ours, theirs, gs):
            x.grad, y.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for x, y in zip(ours, theirs):
        assert torch.equal(x, y)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[x][name], b.state[y][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, FP8], ids=str)
def test_step_against_float64(dtype):
    grads = _grads(STEPS)
    params, opt = _run(dtype, grads=grads)
    w64, m64, v64 = _adam64([p.float() for p in _weights()], grads)
    bound = BOUNDS[dtype]
    for p, w, m, v in zip(params, w64, m64, v64):
        err = (opt.master_param(p).double() - w).abs().max().item() / (STEPS * LR)
        assert err <= bound["master"], f"{dtype} master: {err:.3g} of the total update > {bound['master']}"
        assert_close_to_reference(opt.get_unscaled_state(p, "exp_avg"), m, what="exp_avg", tol=bound["moments"])
        assert_close_to_reference(opt.get_unscaled_state(p, "exp_avg_sq"), v, what="exp_avg_sq", tol=bound["moments"])
        master = opt.master_param(p)
        assert ((p.float() - master).abs() <= master.abs() * 2.0**-8).all()  # the weight follows its master
    names = {n: opt.state[params[0]][n].dtype for n in ("exp_avg", "exp_avg_sq", "master_param")}
    assert names == {"exp_avg": dtype, "exp_avg_sq": dtype, "master_param": torch.int16}


def test_adam_l2_mode_against_float64():
    grads = _grads(STEPS)
    params, opt = _run(torch.float32, grads=grads, adam_w_mode=False)
    w64, _, _ = _adam64([p.float() for p in _weights()], grads, adam_w_mode=False)
    for p, w in zip(params, w64):
        assert (opt.master_param(p).double() - w).abs().max().item() / (STEPS * LR) <= BOUNDS[torch.float32]["master"]


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=str)
def test_remainders_reconstruct_the_fp32_master_bit_for_bit(dtype):
    """bf16 weight + int16 remainder == the fp32 master a plain fp32-master run holds, every bit,
    after every step (the update reads only the master, so the two runs must not diverge)."""
    grads = _grads(8)
    with_rem, opt_rem = _run(dtype, grads=grads, remainders=True)
    plain, opt_plain = _run(dtype, grads=grads, remainders=False)
    for a, b in zip(with_rem, plain):
        master = opt_rem.master_param(a)
        assert torch.equal(master.view(torch.int32), opt_plain.master_param(b).view(torch.int32))
        # the bf16 weight is the master rounded to nearest, ties away from zero: within half a bf16 ulp
        assert ((a.float() - master).abs() <= (master.abs() * 2.0**-8)).all()


def test_remainder_identity_on_special_values():
    """Ties, +-0, subnormals, the largest finite values and +-inf survive weight + remainder exactly."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0xBF808000, 0x00000001, 0x80000001, 0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000]
        + list(range(0x3F800000, 0x3F800000 + 5000, 7)),
        dtype=torch.int64,
    )
    master = bits.to(torch.int32).view(torch.float32)
    p = torch.zeros(master.numel(), dtype=torch.bfloat16)
    opt = PrecisionAwareAdam([p], master_weights=True, store_param_remainders=True, use_decoupled_grad=True)
    opt.initialize_state(p)
    bucket = opt._buckets[id(p)]
    w = torch.zeros(bucket.size)
    w[: p.numel()] = master
    opt._store_master(bucket, 0, bucket.size, bucket.chunks(bucket.size)[0][2], [p.view(-1)], w)
    assert torch.equal(opt.master_param(p).view(torch.int32), master.view(torch.int32))


def test_e4m3_table_decode_is_the_cast_bit_for_bit():
    from mindspeed_like.kernels.adam import e4m3_to_float

    codes = torch.arange(256, dtype=torch.uint8).repeat(3)
    cast = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_to_float(codes).view(torch.int32), cast.view(torch.int32))  # NaN codes included


def test_block_codec_fp8():
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(4 * BLOCK, generator=gen) * torch.tensor([1e-6, 1.0, 1e3, 0.0]).repeat_interleave(BLOCK)
    codes = torch.empty(4 * BLOCK, dtype=torch.uint8)
    scales = torch.empty(4)
    encode_blocks(x, FP8, codes, scales)
    y = decode_blocks(FP8, codes, scales)
    for b in range(4):
        blk = slice(b * BLOCK, (b + 1) * BLOCK)
        amax = x[blk].abs().max()
        assert (y[blk] - x[blk]).abs().max() <= amax * 2.0**-4  # E4M3: 3 mantissa bits, per-block scale
    assert torch.equal(y[3 * BLOCK :], torch.zeros(BLOCK))  # an all-zero block stays exactly zero


def _te_style_adam(params, dtype: torch.dtype, **overrides) -> PrecisionAwareAdam:
    """Megatron's precision-aware setup (TE's FusedAdam arguments): exact masters from bf16 weights
    and int16 remainders, decoupled gradients, both moments in ``dtype``."""
    arguments = dict(lr=LR, betas=BETAS, weight_decay=WD, master_weights=True, store_param_remainders=True)
    arguments.update(use_decoupled_grad=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, **overrides)
    return PrecisionAwareAdam(params, **arguments)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8], ids=str)
def test_state_api_round_trip_and_cross_dtype_load(dtype):
    """state_dict holds fp32 values (int16 remainders); an fp32-state checkpoint loads into ``dtype``
    states and back; get_unscaled_state / set_scaled_state are TE's pair."""
    params, fp32_opt = _run(torch.float32, steps=4)
    sd = fp32_opt.state_dict()
    assert all(v["exp_avg"].dtype == torch.float32 for v in sd["state"].values())
    assert all(v["master_param"].dtype == torch.float32 for v in sd["state"].values())  # the exact master
    low = PrecisionAwareAdam(
        params,
        lr=LR,
        master_weights=True,
        store_param_remainders=True,
        use_decoupled_grad=True,
        exp_avg_dtype=dtype,
        exp_avg_sq_dtype=dtype,
    )
    low.load_state_dict(sd)
    assert low.param_groups[0]["step"] == 4
    back = PrecisionAwareAdam(params, lr=LR, master_weights=True, store_param_remainders=True, use_decoupled_grad=True)
    back.load_state_dict(low.state_dict())
    tol = BOUNDS[dtype]["moments"]
    for p in params:
        assert torch.equal(back.master_param(p), fp32_opt.master_param(p))
        for name in ("exp_avg", "exp_avg_sq"):
            ref = fp32_opt.get_unscaled_state(p, name).double()
            assert_close_to_reference(low.get_unscaled_state(p, name), ref, what=name, tol=tol)
            assert_close_to_reference(back.get_unscaled_state(p, name), ref, what=name, tol=tol)
        value = torch.full(p.shape, 0.25)
        low.set_scaled_state(p, "exp_avg", value)
        assert torch.equal(low.get_unscaled_state(p, "exp_avg"), value)  # 0.25 is exact in every dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=str)
def test_step_in_pieces_is_bitwise_the_whole_bucket_step(dtype, monkeypatch):
    """The step runs piece by piece (STEP_CHUNK elements, for cache): pieces of 2 blocks cut
    through every parameter here, a frozen one and a non-contiguous one included, and give the
    whole-bucket step's bits."""
    from mindspeed_like.kernels import adam

    def run(chunk: int):
        monkeypatch.setattr(adam, "STEP_CHUNK", chunk)
        params = _weights()
        params[0] = params[0].t()  # non-contiguous [33, 64]
        opt = _te_style_adam(params, dtype)
        for step, gs in enumerate(_grads(4)):
            for i, (p, g) in enumerate(zip(params, gs)):
                p.decoupled_grad = None if (i == 2 and step == 2) else g.view(p.shape).bfloat16()
            opt.step()
        return [(p.clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]

    whole, pieces = run(1 << 30), run(2 * BLOCK)
    for (w1, s1), (w2, s2) in zip(whole, pieces):
        assert torch.equal(w1, w2)
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


class _NoHostRead(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that reads tensor data on the host (a device sync on an accelerator)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func not in self.READS, f"host read in the step: {func}"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8], ids=str)
def test_cuda_backend_steps_in_its_own_pieces_without_host_reads(dtype, monkeypatch):
    """On CUDA (the ``cuda`` backend, forced here on CPU tensors) the step takes pieces of
    CUDA_STEP_CHUNK elements (2 blocks here, the host's STEP_CHUNK made whole-bucket): the same
    bits as the whole-bucket step, and no op reads tensor data on the host."""
    from mindspeed_like.kernels import adam
    from mindspeed_like.kernels.backend import force_backend

    monkeypatch.setattr(adam, "STEP_CHUNK", 1 << 30)

    def run(backend: str):
        params = _weights()
        opt = _te_style_adam(params, dtype)
        for gs in _grads(3):
            for p, g in zip(params, gs):
                p.decoupled_grad = g.view(p.shape).bfloat16()
            with force_backend(backend), _NoHostRead():
                opt.step()
        chunks = {c for b in opt._buckets.values() for c in b.plans}
        return [(p.clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params], chunks

    monkeypatch.setattr(adam, "CUDA_STEP_CHUNK", 2 * BLOCK)
    (whole, host_chunks), (pieces, cuda_chunks) = run("portable"), run("cuda")
    assert host_chunks == {1 << 30} and cuda_chunks == {2 * BLOCK}
    for (w1, s1), (w2, s2) in zip(whole, pieces):
        assert torch.equal(w1, w2)
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_params_without_grad_keep_weight_and_state():
    params, opt = _run(FP8, steps=3)
    before = {id(p): (p.clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params}
    params[1].decoupled_grad = None
    for p in (params[0], params[2], params[3]):
        p.decoupled_grad = torch.ones_like(p)
    opt.step()
    weight, state = before[id(params[1])]
    assert torch.equal(params[1], weight)
    assert all(torch.equal(opt.state[params[1]][k], v) for k, v in state.items())
    assert not torch.equal(params[0], before[id(params[0])][0])


def test_contract_errors():
    p = [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        PrecisionAwareAdam(p, exp_avg_dtype=torch.int8)
    with pytest.raises(ValueError, match="master_weight_dtype"):
        PrecisionAwareAdam(p, master_weights=True, master_weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="AMSGrad"):
        PrecisionAwareAdam(p, amsgrad=True)
    opt = PrecisionAwareAdam(p, master_weights=True, store_param_remainders=True)
    with pytest.raises(TypeError, match="fp32 master or TE's int16 remainder"):
        opt.set_scaled_state(p[0], "master_param", torch.zeros(3, dtype=torch.float64))


def test_fp32_master_sets_weight_and_remainder():
    """megatron's checkpoints carry fp32 masters: set_scaled_state splits one into the bf16 weight
    (ties away from zero) and the remainder, and get_unscaled_state gives it back bit for bit;
    TE's int16 remainder form is accepted too."""
    gen = torch.Generator().manual_seed(SEED)
    master = torch.randn(300, generator=gen)
    ties = torch.tensor([0x3F808000, 0xBF808000, 0x3F818000], dtype=torch.int64).to(torch.int32)
    master[:3] = ties.view(torch.float32)  # exact ties between two bf16 values
    p = torch.zeros(300, dtype=torch.bfloat16)
    opt = PrecisionAwareAdam([p], master_weights=True, store_param_remainders=True, use_decoupled_grad=True)
    opt.set_scaled_state(p, "master_param", master.clone())
    assert torch.equal(opt.get_unscaled_state(p, "master_param").view(torch.int32), master.view(torch.int32))
    assert p[:3].tolist() == [1.0078125, -1.0078125, 1.015625]  # ties rounded away from zero
    remainder = opt.state[p]["master_param"].clone()
    opt.set_scaled_state(p, "master_param", torch.zeros_like(remainder))
    opt.set_scaled_state(p, "master_param", remainder)
    assert torch.equal(opt.master_param(p).view(torch.int32), master.view(torch.int32))
