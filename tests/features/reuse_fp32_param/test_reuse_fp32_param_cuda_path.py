"""reuse-fp32-param's CUDA path (the ``cuda`` kernel backend: tie bitmasks, batched step) checked on
this CPU: forced with ``force_backend("cuda")`` on CPU tensors it runs everything but the Triton
kernels (``tests/kernels`` checks those in Triton's interpreter, and on a GPU they are compared
with the eager ops before first use).

- bitwise megatron's Float16 optimizer over several steps, with exact ties crafted into every
  parameter, pieces split across batches and parameters, and torch's foreach Adam;
- no host sync in the step: a dispatch guard that fails on any host read of tensor data (and on
  ``.tolist()``) but the step counters', around the real step;
- on tensors that live "on the GPU" (``testing/fake_cuda.py``: CUDA's placement rule on every op):
  torch picks its foreach Adam, and the pieces are bitwise ``torch.optim.AdamW``'s step;
- the DistributedOptimizer's layouts at unaligned offsets, and (slow) at DP=2 in 2 gloo
  processes with a checkpoint read mid-training;
- the prepared GPU check script, on a tiny model.
"""

from __future__ import annotations

import pytest
import reuse_fp32_workers as W
import torch
from test_reuse_fp32_param import _crafted_masters, _state_of
from torch.utils._python_dispatch import TorchDispatchMode

import mindspeed_like
from mindspeed_like.features.reuse_fp32_param import chunked_step
from mindspeed_like.kernels import bf16_residual as K
from mindspeed_like.kernels import bf16_ties
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.testing import destroy_parallel, run_distributed
from mindspeed_like.testing.bf16_patterns import hard_masters

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _reset():
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _foreach(opt) -> None:
    """torch's foreach Adam (what megatron's AdamW picks on CUDA) in both runs."""
    for inner in W.inner_optimizers(opt):
        for group in inner.optimizer.param_groups:
            group["foreach"] = True


def test_float16_step_bitwise_with_ties_split_pieces_and_foreach():
    """Masters full of exact ties, batches of 1000 elements (pieces cut inside parameters and
    several parameters per batch), foreach Adam with weight decay: 5 steps bitwise megatron's."""
    seen = {}

    def prepare(model, opt):
        _crafted_masters(opt)  # load_state_dict: the shuffling conversion with the bitmask
        _foreach(opt)
        state = _state_of(opt)
        if state is not None:
            seen["kinds"] = {type(e.side).__name__ for e in state.entries}
            seen["ties"] = sum(e.side.count() for e in state.entries)
            seen["bytes"] = state.extra_bytes(), sum((e.buf.numel() // 2 + 7) // 8 for e in state.entries)
            state.batch = 1000

    optimizer = dict(optimizer="adam", weight_decay=0.1)
    baseline = W.train(False, 5, prepare=prepare, optimizer=optimizer)
    with force_backend("cuda"):
        ours = W.train(True, 5, prepare=prepare, optimizer=optimizer)
    assert W.same(baseline, ours)
    assert seen["kinds"] == {"BitTies"} and seen["ties"] > 1000
    assert seen["bytes"][0] == seen["bytes"][1]  # extra_bytes counts the bitmasks: ceil(n / 8) each


class _NoHostSync(TorchDispatchMode):
    """Raises on an op that reads tensor data on the host (a device sync on CUDA) unless it reads
    one of ``optimizer``'s step counters (host tensors in torch's non-capturable Adam)."""

    READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
    READS |= {aten.equal.default, aten.is_nonzero.default, aten._unique2.default}

    def __init__(self, optimizer) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            steps = {id(s.get("step")) for s in self.optimizer.state.values()}
            if not (func is aten._local_scalar_dense.default and id(args[0]) in steps):
                raise AssertionError(f"host sync in the step: {func}")
        if func in (aten.index.Tensor, aten.index_put_.default) and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            raise AssertionError(f"boolean indexing (a nonzero) in the step: {func}")
        return func(*args, **kwargs)


def _guarded_step(calls: list):
    real = chunked_step.step

    def tolist(self):
        raise AssertionError("host sync in the step: .tolist()")

    def step(optimizer, entries, batch):
        with pytest.MonkeyPatch.context() as patch, _NoHostSync(optimizer):
            patch.setattr(torch.Tensor, "tolist", tolist)
            calls.append(real(optimizer, entries, batch))
        return calls[-1]

    return step


def test_float16_step_has_no_host_sync(monkeypatch):
    """The whole chunked step (decode, torch's Adam, encode) under a guard that fails on any host
    read of tensor data but the step counters'; the index-table path trips the same guard."""
    calls: list = []
    monkeypatch.setattr(chunked_step, "step", _guarded_step(calls))
    with force_backend("cuda"):
        W.train(True, 3, optimizer=dict(optimizer="adam", weight_decay=0.1), prepare=lambda m, o: _foreach(o))
    assert calls == [True, True, True]
    with pytest.raises(AssertionError, match="host sync in the step"):  # the guard is not vacuous
        W.train(True, 1, prepare=lambda m, o: _crafted_masters(o))  # portable backend: index tables


def test_float16_step_on_fake_cuda_is_torchs_foreach_adamw(monkeypatch):
    """The step on tensors that live "on the GPU" (``testing.fake_cuda``: every operation checked
    with CUDA's placement rule, so a host tensor mixed in raises): torch picks its foreach Adam
    for them, as for megatron's masters on CUDA, and three steps of pieces of 256 elements are
    bitwise ``torch.optim.AdamW`` on the full fp32 masters (masters with ties at both edges,
    bf16 weights, both moments), with no host read but the step counters'. (torch's
    ``FakeTensorMode`` cannot slice a ``cuda`` tensor on a CPU-only build.)"""
    from torch.optim import adam as torch_adam

    from mindspeed_like.testing.fake_cuda import fake_cuda

    monkeypatch.setitem(bf16_ties._checked, torch.device("cuda", 0), False)  # no Triton here: eager bit ops
    foreach_calls = []
    multi = torch_adam._multi_tensor_adam
    monkeypatch.setattr(torch_adam, "_multi_tensor_adam", lambda *a, **k: foreach_calls.append(1) or multi(*a, **k))
    shapes = [(37, 11), (300,), (5,), (0,), (129, 3)]  # an empty one: torch's own step
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(shape, generator=g) for shape in shapes]
    for m in masters:  # exact ties: rounded down onto an even high half (d = +32768), up from an odd one
        words = m.view(-1).view(torch.int32)
        words[::7] = (words[::7] & ~0x1FFFF) | 0x8000
        words[3::11] = (words[3::11] & ~0x1FFFF) | 0x18000
    grads = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(3)]
    with fake_cuda():
        reference = [m.cuda() for m in masters]
        buffers = [K.new_buffer(m.to(torch.bfloat16).cuda()) for m in masters]
        entries, mains = {}, []
        for buf, m, shape in zip(buffers, reference, shapes):
            main = K.fp32_view(buf, shape)
            entry = type("Shared", (), {})()
            entry.buf, entry.side = buf, K.new_ties(m.numel(), buf)
            K.encode_split(buf, 0, m.numel(), m.reshape(-1), entry.side)
            entry.side.commit()
            entries[id(main)] = entry
            mains.append(main)
        assert {type(e.side) for e in entries.values()} == {K.BitTies} and sum(e.side.count() for e in entries.values())
        ours = torch.optim.AdamW(mains, lr=1e-2, weight_decay=0.1)
        theirs = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
        for step_grads in grads:
            for main, ref, grad in zip(mains, reference, step_grads):
                main.grad, ref.grad = grad.cuda(), grad.cuda()
            with _NoHostSync(ours):
                assert chunked_step.step(ours, entries, batch=256)
            theirs.step()
            for main, ref, entry in zip(mains, reference, entries.values()):
                n = ref.numel()
                master = K.master_copy(entry.buf, entry.side, ref.shape)
                assert torch.equal(master.view(torch.int32), ref.view(torch.int32))
                assert torch.equal(entry.buf[:n], ref.reshape(-1).to(torch.bfloat16).view(torch.int16))
                for name in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(ours.state[main][name], theirs.state[ref][name]), name
    assert len(foreach_calls) >= 2 * 3  # both optimizers, every step


def test_plan_cuts_aligned_pieces_within_the_capacity():
    batches = chunked_step.plan([1000, 5, 300, 129], capacity=512)
    for batch in batches:
        assert sum(-(-(p.stop - p.start) // chunked_step.ALIGN) * chunked_step.ALIGN for p in batch) <= 512
        assert len({p.slot for p in batch}) == len(batch)  # a parameter at most once per batch
    for slot, n in enumerate([1000, 5, 300, 129]):
        pieces = [p for batch in batches for p in batch if p.slot == slot]
        assert pieces[0].start == 0 and pieces[-1].stop == n
        assert all(a.stop == b.start and a.stop % chunked_step.ALIGN == 0 for a, b in zip(pieces, pieces[1:]))


@pytest.mark.slow
def test_distributed_optimizer_dp2_bitwise():
    """DP=2 DistributedOptimizer with the bitmask: bitwise megatron's over 6 steps, masters read
    through the checkpoint path (materialize) before step 4 and split back after it; the extra
    bytes are the residual shard plus ceil(S / 8) bytes of bitmask."""
    ranks = run_distributed(W.distributed_optimizer_cuda_path, 2, 6, timeout=600)
    for rank in ranks:
        base, ours = rank["base"], rank["ours"]
        assert base["losses"] == ours["losses"]
        assert W.equal(base["after"]["masters"], ours["after"]["masters"])
        assert W.equal(base["weights"], ours["weights"])
        assert rank["kinds"] == ["BitTies"] and rank["materialized"] == "materialized"
        assert rank["extra"] == rank["expected_extra"]


@pytest.mark.parametrize("backend", ["portable", "cuda"])
@pytest.mark.parametrize("last_rank", [False, True], ids=["rank0", "last-rank"])
def test_distributed_layouts_round_trip_exactly(backend, last_rank):
    """The DistributedOptimizer layouts on one bucket shard (no megatron): entries at unaligned
    offsets (bitmask bytes shared by two entries), chunks of 64 (the scratch build's overlapping
    first/last chunks included), masters with ties at both edges, NaN, +-inf, subnormals:
    materialized -> split -> scratch -> (a step) -> split -> materialized keeps every master."""
    from mindspeed_like.features.reuse_fp32_param import distributed as D

    size, dp = 1000, 2
    sizes = [13, 300, 500, 187]
    rank = dp - 1 if last_rank else 0
    param16 = torch.zeros(dp * size, dtype=torch.bfloat16).view(torch.int16)
    with force_backend(backend):
        side = K.new_ties(size, param16)
    bucket = D.BucketShard(
        param16=param16,
        own=rank * size,
        size=size,
        scratch=(rank - 1) * size if last_rank else rank * size,
        descending=not last_rank,
        residual=torch.zeros(size, dtype=torch.int16),
        side=side,
    )
    masters = hard_masters(size, seed=11)
    state = D.DistState(buckets=[bucket], layout="materialized", chunk=64)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for offset, n in zip(offsets, sizes):
        state.entries.append(D.Entry(masters[offset : offset + n].clone(), 0, offset))

    def check(expected: torch.Tensor) -> None:
        b, r, ties = K.split_reference(expected)
        nan = torch.isnan(expected)
        own = param16[bucket.own : bucket.own + size]
        assert torch.equal(own[~nan], b.view(torch.int16)[~nan]) and torch.equal(bucket.residual, r)
        assert bucket.side.count() == ties.numel()
        state.materialize()
        got = torch.cat([e.main.detach() for e in state.entries])
        assert torch.equal(got.view(torch.int32)[~nan], expected.view(torch.int32)[~nan])
        assert torch.isnan(got[nan]).all()

    state.to_split()  # from materialized masters
    assert type(bucket.side).__name__ == ("BitTies" if backend == "cuda" else "SparseTies")
    check(masters)
    state.to_split()
    state.to_fp32()  # the scratch layout, built in place inside the param buffer
    assert state.layout == "scratch"
    stepped = masters.clone()
    for entry, offset, n in zip(state.entries, offsets, sizes):
        assert torch.equal(
            entry.main.view(torch.int32)[~torch.isnan(entry.main)],
            masters[offset : offset + n].view(torch.int32)[~torch.isnan(entry.main)],
        )
        entry.main.view(torch.int32)[::5] += 0x8000  # a "step" that lands on ties
        stepped[offset : offset + n] = entry.main
    state.to_split()
    check(stepped)


def test_gpu_check_script_runs_its_cuda_path_here():
    """``python3 -m mindspeed_like.testing.optimizer_step_check`` (the one prepared GPU run) on a tiny
    model with the cuda backend forced: it builds both optimizers, finds them bitwise equal with the
    bitmask in use, and reports every line."""
    from mindspeed_like.testing import optimizer_step_check

    out = optimizer_step_check.main(
        ["--device", "cpu", "--quick", "--steps", "2", "--repeats", "2", "--no-precision-aware", "--backend", "cuda"]
    )
    assert out["bitwise"] == {"bf16 weights": True, "fp32 masters": True, "exp_avg": True, "exp_avg_sq": True}
    assert any("tie record ['BitTies']" in line for line in out["lines"])
    assert out["float16"]["megatron_ms"] > 0 and out["float16"]["reuse_ms"] > 0


def test_weight_decay_is_folded_only_where_torch_applies_it_as_one_multiply():
    """AdamW's decoupled decay goes into the decode (torch's call then gets weight_decay=0) for the
    single-tensor and foreach implementations with a float lr; never for fused, L2 (Adam) decay,
    a tensor lr or no decay. (Bitwise effect: the step tests above run with weight decay 0.1.)"""
    base = dict(lr=1e-3, weight_decay=0.1, fused=None, differentiable=False, decoupled_weight_decay=True)
    kwargs, scale = chunked_step.fold_weight_decay(base)
    assert kwargs["weight_decay"] == 0.0 and scale == 1 - 1e-3 * 0.1 and base["weight_decay"] == 0.1
    for change in (
        dict(fused=True),
        dict(decoupled_weight_decay=False),
        dict(lr=torch.tensor(1e-3)),
        dict(weight_decay=0),
    ):
        kwargs, scale = chunked_step.fold_weight_decay({**base, **change})
        assert scale is None and kwargs["weight_decay"] == {**base, **change}["weight_decay"], change
