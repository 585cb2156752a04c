"""moe-alltoall-overlap, single process: the chunk plan, the pipeline on a fake 2-rank expert-
parallel group (two threads exchanging rows), its schedule, and the fallbacks / configuration
errors. The EP=2 GPT parity in gloo processes is in test_moe_alltoall_overlap_distributed.py."""

from __future__ import annotations

import argparse
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from mindspeed_like.features.moe_alltoall_overlap import megatron_args_check
from mindspeed_like.features.moe_alltoall_overlap.dispatcher import MoeAlltoAllOverlapUnsupported, why_not
from mindspeed_like.features.moe_alltoall_overlap.pipeline import ChunkPlan, SharedPart, overlapped_experts
from mindspeed_like.toolkit.errors import ConfigError

RANKS, EXPERTS, HIDDEN = 2, 3, 8  # 3 local experts per rank: 3 chunks


class FakeGroup:
    """An all-to-all among ``ranks`` threads: the n-th call of every rank forms one collective.
    ``issue`` returns at once; ``wait`` blocks until every rank has issued that collective. Each
    rank's calls are logged (``events[rank]``) to check the schedule."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.cond = threading.Condition()
        self.posted: dict[int, dict[int, list[torch.Tensor]]] = {}
        self.events: dict[int, list[tuple]] = {r: [] for r in range(ranks)}

    def exchange_for(self, rank: int):
        count = [0]

        def exchange(output, data, out_splits, in_splits):
            index = count[0]
            count[0] += 1
            with self.cond:
                self.posted.setdefault(index, {})[rank] = list(torch.split(data.clone(), in_splits))
                self.cond.notify_all()
            self.events[rank].append(("issue", index))
            group = self

            class Work:
                def wait(self):
                    with group.cond:
                        group.cond.wait_for(lambda: len(group.posted[index]) == group.ranks)
                        parts = [group.posted[index][src][rank] for src in range(group.ranks)]
                    assert [p.shape[0] for p in parts] == list(out_splits), "split sizes disagree between ranks"
                    output.copy_(torch.cat(parts))
                    group.events[rank].append(("wait", index))

            return Work()

        return exchange


def _routing(seed: int) -> list[torch.Tensor]:
    """Per rank: rows per global expert (some zero), tokens, probs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(RANKS):
        counts = torch.randint(0, 5, (RANKS * EXPERTS,), generator=gen)
        counts[1] = 0  # an expert that gets nothing from this rank
        rows = int(counts.sum())
        out.append((counts, torch.randn(rows, HIDDEN, generator=gen), torch.rand(rows, generator=gen)))
    return out


def _plans(routing) -> list[ChunkPlan]:
    plans = []
    for me in range(RANKS):
        received = [[int(routing[r][0][me * EXPERTS + e]) for e in range(EXPERTS)] for r in range(RANKS)]
        plans.append(ChunkPlan.from_counts(routing[me][0].tolist(), received))
    return plans


def _weights(seed: int) -> list[list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen)) for _ in range(EXPERTS)] for _ in range(RANKS)
    ]


def _expert(weights, e, x, p):
    return torch.tanh(x @ weights[e]) * p.unsqueeze(-1)


def _reference(routing, weights):
    """megatron's blocking path computed directly: expert (d, e) sees, in source-rank order,
    every rank's segment for global expert d * E + e; results go back to the same rows."""
    tokens = [t.clone().requires_grad_() for _, t, _ in routing]
    probs = [p.clone().requires_grad_() for _, _, p in routing]
    offsets = [torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), c]), 0).tolist() for c, _, _ in routing]
    outputs = [[None] * (RANKS * EXPERTS) for _ in range(RANKS)]
    for d in range(RANKS):
        for e in range(EXPERTS):
            g = d * EXPERTS + e
            xs = [tokens[r][offsets[r][g] : offsets[r][g + 1]] for r in range(RANKS)]
            ps = [probs[r][offsets[r][g] : offsets[r][g + 1]] for r in range(RANKS)]
            y = _expert(weights[d], e, torch.cat(xs), torch.cat(ps))
            for r, part in enumerate(torch.split(y, [x.shape[0] for x in xs])):
                outputs[r][g] = part
    return tokens, probs, [torch.cat(outputs[r]) for r in range(RANKS)]


def _run_ranks(fn):
    results, errors = [None] * RANKS, []

    def target(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def test_plan_segments_round_trip():
    plan = ChunkPlan.from_counts([2, 0, 3, 1, 4, 2], [[5, 1, 0], [2, 2, 2]])
    assert plan.send_counts == ((2, 1), (0, 4), (3, 2)) and plan.recv_counts == ((5, 2), (1, 2), (0, 2))
    rows = torch.arange(plan.local_rows).float().unsqueeze(1)
    chunks = [plan.gather_chunk(rows, e) for e in range(plan.chunks)]
    assert chunks[0].squeeze(1).tolist() == [0, 1, 5]  # global expert 0 (rows 0-1), then 3 (row 5)
    assert torch.equal(plan.scatter_chunks(chunks), rows)
    with pytest.raises(ValueError, match="global experts"):
        ChunkPlan.from_counts([1, 2, 3], [[1, 1], [1, 1]])


@pytest.mark.parametrize("recompute", [False, True], ids=["overlap", "zero_memory"])
def test_pipeline_bitwise_equals_the_blocking_path_forward_and_backward(recompute):
    routing, weights = _routing(7), _weights(8)
    ref_tokens, ref_probs, ref_out = _reference(routing, weights)
    grads_out = [torch.randn_like(o) for o in ref_out]
    torch.autograd.backward(ref_out, grads_out)
    plans, group = _plans(routing), FakeGroup(RANKS)
    mine = [[torch.nn.Parameter(w.detach().clone()) for w in ws] for ws in weights]

    def rank(r):
        tokens = routing[r][1].clone().requires_grad_()
        probs = routing[r][2].clone().requires_grad_()
        out = overlapped_experts(
            plans[r],
            group.exchange_for(r),
            lambda e, x, p: _expert(mine[r], e, x, p),
            tokens,
            probs,
            mine[r],
            recompute=recompute,
        )
        out.backward(grads_out[r])
        return out.detach(), tokens.grad, probs.grad

    for r, (out, g_tokens, g_probs) in enumerate(_run_ranks(rank)):
        assert torch.equal(out, ref_out[r].detach())
        assert torch.equal(g_tokens, ref_tokens[r].grad)
        assert torch.equal(g_probs, ref_probs[r].grad)
        for e in range(EXPERTS):
            assert torch.equal(mine[r][e].grad, weights[r][e].grad), f"rank {r} expert {e} weight grad"


def test_schedule_keeps_the_next_chunk_in_flight_under_each_expert():
    """Forward: every dispatch is issued before expert 0 runs and combine e is issued before
    expert e + 1 runs and waited only after the last expert; backward the same with the
    gradient all-to-alls. (On a link that takes time, that is what hides the transfers.)"""
    routing, weights = _routing(3), _weights(4)
    plans, group = _plans(routing), FakeGroup(RANKS)
    expert_log: dict[int, list] = {r: [] for r in range(RANKS)}

    def rank(r):
        tokens = routing[r][1].clone().requires_grad_()
        probs = routing[r][2].clone().requires_grad_()

        def run(e, x, p):
            group.events[r].append(("expert", e))
            expert_log[r].append(len(group.events[r]))
            return _expert(weights[r], e, x, p)

        out = overlapped_experts(plans[r], group.exchange_for(r), run, tokens, probs, weights[r])
        group.events[r].append(("backward",))
        out.sum().backward()

    _run_ranks(rank)
    n = EXPERTS
    for r in range(RANKS):
        ev = group.events[r]
        fwd = ev[: ev.index(("backward",))]
        # dispatch: 2 collectives per chunk (tokens, probs) = ids 0 .. 2n-1, combine ids 2n .. 3n-1
        assert [x for x in fwd[: 2 * n]] == [("issue", i) for i in range(2 * n)]
        for e in range(n - 1):
            assert fwd.index(("issue", 2 * n + e)) < fwd.index(("expert", e + 1))
            assert fwd.index(("wait", 2 * n + e)) > fwd.index(("expert", n - 1))
        bwd = ev[ev.index(("backward",)) + 1 :]
        first = 3 * n  # backward: n gradient-of-combine all-to-alls, then 2 per chunk back
        assert bwd[:n] == [("issue", first + e) for e in range(n)]
        waits = [i for i, x in enumerate(bwd) if x[0] == "wait"]
        issued_back = [i for i, x in enumerate(bwd) if x == ("issue", first + n)]
        assert waits[0] < issued_back[0] < bwd.index(("wait", first + 1))  # chunk 0 back before chunk 1's wait


def _shared_weights(seed: int) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen)) for _ in range(2)) for _ in range(RANKS)
    ]


def _shared_expert(w, x):
    return torch.relu(x @ w[0]) @ w[1]


@pytest.mark.parametrize("recompute", [False, True], ids=["overlap", "zero_memory"])
def test_shared_experts_in_the_pipeline_equal_computing_them_apart(recompute):
    """The shared experts as the pipeline's piece (megatron's moe_shared_expert_overlap): their
    output and every gradient (input, their weights) bitwise what they give on their own, and
    the routed experts' results unchanged."""
    routing, weights, shared_w = _routing(11), _weights(12), _shared_weights(13)
    ref_tokens, ref_probs, ref_out = _reference(routing, weights)
    inputs = [torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(20 + r)) for r in range(RANKS)]
    ref_inputs = [x.clone().requires_grad_() for x in inputs]
    ref_shared = [_shared_expert(shared_w[r], ref_inputs[r]) for r in range(RANKS)]
    grads_out = [torch.randn_like(o) for o in ref_out]
    grads_shared = [torch.randn_like(o) for o in ref_shared]
    torch.autograd.backward([*ref_out, *ref_shared], [*grads_out, *grads_shared])
    plans, group = _plans(routing), FakeGroup(RANKS)
    mine = [[torch.nn.Parameter(w.detach().clone()) for w in ws] for ws in weights]
    mine_shared = [tuple(torch.nn.Parameter(w.detach().clone()) for w in ws) for ws in shared_w]

    def rank(r):
        tokens = routing[r][1].clone().requires_grad_()
        probs = routing[r][2].clone().requires_grad_()
        x = inputs[r].clone().requires_grad_()
        part = SharedPart(lambda h: _shared_expert(mine_shared[r], h), mine_shared[r])
        out, shared = overlapped_experts(
            plans[r],
            group.exchange_for(r),
            lambda e, t, p: _expert(mine[r], e, t, p),
            tokens,
            probs,
            mine[r],
            recompute,
            part,
            x,
        )
        torch.autograd.backward([out, shared], [grads_out[r], grads_shared[r]])
        return out.detach(), shared.detach(), tokens.grad, probs.grad, x.grad

    for r, (out, shared, g_tokens, g_probs, g_x) in enumerate(_run_ranks(rank)):
        assert torch.equal(out, ref_out[r].detach()) and torch.equal(shared, ref_shared[r].detach())
        assert torch.equal(g_tokens, ref_tokens[r].grad) and torch.equal(g_probs, ref_probs[r].grad)
        assert torch.equal(g_x, ref_inputs[r].grad)
        for mine_w, ref_w in zip(mine_shared[r], shared_w[r]):
            assert torch.equal(mine_w.grad, ref_w.grad), f"rank {r}: shared expert weight grad"
        for e in range(EXPERTS):
            assert torch.equal(mine[r][e].grad, weights[r][e].grad), f"rank {r} expert {e} weight grad"


def test_shared_experts_run_while_the_all_to_alls_are_in_flight():
    """Forward: the shared experts run after every dispatch all-to-all is issued and before the
    first is waited for; backward: after every combine-gradient all-to-all is issued and before
    the first is waited for (on a host, what they overlap with)."""
    routing, weights, shared_w = _routing(3), _weights(4), _shared_weights(5)
    plans, group = _plans(routing), FakeGroup(RANKS)

    def rank(r):
        tokens = routing[r][1].clone().requires_grad_()
        probs = routing[r][2].clone().requires_grad_()
        x = torch.randn(4, HIDDEN, requires_grad=True)

        class Logged(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h):
                group.events[r].append(("shared forward",))
                return h.clone()

            @staticmethod
            def backward(ctx, g):
                group.events[r].append(("shared backward",))
                return g

        part = SharedPart(lambda h: _shared_expert(shared_w[r], Logged.apply(h)), shared_w[r])
        out, shared = overlapped_experts(
            plans[r], group.exchange_for(r), lambda e, t, p: _expert(weights[r], e, t, p), tokens, probs,
            weights[r], False, part, x,
        )  # fmt: skip
        group.events[r].append(("backward",))
        (out.sum() + shared.sum()).backward()

    _run_ranks(rank)
    n = EXPERTS
    for r in range(RANKS):
        ev = group.events[r]
        assert ev[: 2 * n + 1] == [*[("issue", i) for i in range(2 * n)], ("shared forward",)]
        assert ev.index(("shared forward",)) < ev.index(("wait", 0))
        bwd = ev[ev.index(("backward",)) + 1 :]
        assert bwd[: n + 1] == [*[("issue", 3 * n + e) for e in range(n)], ("shared backward",)]


def test_zero_memory_keeps_exactly_the_dispatched_rows_and_probs():
    """moe-zero-memory's recompute: saved for backward = each chunk's received rows and probs,
    nothing of the experts' activations (which the plain pipeline keeps, as megatron does)."""
    from mindspeed_like.testing import SavedBytesMeter

    routing, weights = _routing(11), _weights(12)
    plans = _plans(routing)
    saved = {}
    for recompute in (False, True):
        group = FakeGroup(RANKS)

        def rank(r, group=group, recompute=recompute):
            tokens = routing[r][1].clone().requires_grad_()
            probs = routing[r][2].clone().requires_grad_()
            with SavedBytesMeter() as meter:
                out = overlapped_experts(
                    plans[r],
                    group.exchange_for(r),
                    lambda e, x, p: _expert(weights[r], e, x, p),
                    tokens,
                    probs,
                    weights[r],
                    recompute=recompute,
                )
            out.sum().backward()
            return meter.bytes

        saved[recompute] = _run_ranks(rank)
    for r in range(RANKS):
        received = sum(map(sum, plans[r].recv_counts))
        assert saved[True][r] == received * HIDDEN * 4 + received * 4  # fp32 rows + fp32 probs
        assert saved[True][r] < saved[False][r]


def _dispatcher(**overrides):
    values = dict(ep_size=2, tp_size=1, num_local_experts=2, drop_and_pad=False, shared_experts=None)
    config = SimpleNamespace(gradient_accumulation_fusion=False, delay_wgrad_compute=False, cuda_graph_impl="none")
    for key in list(overrides):
        if hasattr(config, key):
            setattr(config, key, overrides.pop(key))
    values.update(overrides)
    return SimpleNamespace(config=config, **values)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(ep_size=1), "expert_model_parallel_size is 1"),
        (dict(tp_size=2), "expert_tensor_parallel_size"),
        (dict(num_local_experts=1), "one expert per EP rank"),
        (dict(drop_and_pad=True), "moe_pad_expert_input_to_capacity"),
        (dict(gradient_accumulation_fusion=True), "gradient_accumulation_fusion"),
        (dict(delay_wgrad_compute=True), "delay_wgrad_compute"),
        (dict(cuda_graph_impl="local"), "CUDA graphs"),
    ],
)
def test_why_not_names_each_unsupported_setting(overrides, reason):
    assert why_not(_dispatcher()) is None
    assert reason in why_not(_dispatcher(**overrides))


def test_megatron_lm_args_with_another_dispatcher_are_a_config_error():
    args = argparse.Namespace(num_experts=4, moe_token_dispatcher_type="allgather")
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type alltoall"):
        with megatron_args_check(args):
            pass
    for fine in (argparse.Namespace(num_experts=4, moe_token_dispatcher_type="alltoall"), argparse.Namespace()):
        with megatron_args_check(fine):
            pass


@pytest.mark.parametrize("option", ["--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"])
def test_primary_and_mindspeed_spellings_switch_it_on(option):
    from mindspeed_like import runtime

    assert runtime.resolve_config(argv=[option])["moe_alltoall_overlap_comm"]
    assert "moe-alltoall-overlap" in runtime.enabled_feature_names(runtime.resolve_config(argv=[option]))
    assert "moe-alltoall-overlap" not in runtime.enabled_feature_names(runtime.resolve_config(argv=[]))


def _forward_moe(**model_kwargs):
    from mindspeed_like.testing import init_parallel, tiny_gpt

    init_parallel()
    model = tiny_gpt(**model_kwargs)
    tokens = torch.randint(0, 256, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    return model(tokens, positions, None)


def test_expert_parallel_one_is_said_once(cpu_config, caplog):
    cpu_config(moe_alltoall_overlap_comm=True)
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        _forward_moe(num_moe_experts=4)
    said = [r for r in caplog.records if "expert_model_parallel_size is 1" in r.getMessage()]
    assert len(said) == 1  # two MoE layers, one line


def test_other_dispatcher_is_said_once_and_refused_under_strict(cpu_config, caplog):
    cpu_config(moe_alltoall_overlap_comm=True)
    with caplog.at_level(logging.INFO, logger="mindspeed_like"):
        _forward_moe(num_moe_experts=4, moe_token_dispatcher_type="allgather")
    assert len([r for r in caplog.records if "not the alltoall dispatcher" in r.getMessage()]) == 1
    cpu_config(moe_alltoall_overlap_comm=True, strict=True)
    with pytest.raises(MoeAlltoAllOverlapUnsupported, match="not the alltoall dispatcher"):
        _forward_moe(num_moe_experts=4, moe_token_dispatcher_type="allgather")
