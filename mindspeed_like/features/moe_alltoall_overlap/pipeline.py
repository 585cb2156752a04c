"""The chunked all-to-all pipeline of the alltoall token dispatcher, free of megatron.

megatron's ``MoEAlltoAllTokenDispatcher`` sends all permuted tokens in one blocking
all-to-all, the experts compute, and one blocking all-to-all brings the results back. Here the
tokens are cut into one chunk per LOCAL EXPERT: chunk ``e`` holds, from every source rank, the
tokens routed to local expert ``e`` of each destination rank. All chunks' dispatch
all-to-alls are issued at once (asynchronously, in chunk order); expert ``e`` computes as soon
as chunk ``e`` has arrived, while the later chunks are still on the link, and its results go
back with an async all-to-all issued right after it, under expert ``e + 1``'s compute. The
backward pass is the same pipeline in reverse order of roles (gradients of the combine
all-to-all first, expert backward per chunk, the dispatch's gradient all-to-all under the next
chunk's backward).

Why chunks are experts and not token slices: each expert then sees exactly the rows megatron
gives it, in megatron's order (its rows from source rank 0, then rank 1, ...: what
``sort_chunks_by_idxs`` produces), and its weight gradient is one matmul over those rows, as in
megatron. Results are bitwise megatron's; cutting an expert's rows in pieces would sum its
weight gradient in pieces (rounding-level differences).

Shared experts (megatron's ``moe_shared_expert_overlap``): their whole forward runs right after
the dispatch all-to-alls are issued, before the first chunk is waited for, and their backward
right after the combine's gradient all-to-alls are issued: on a host without a second stream,
the asynchronous collectives are what they overlap with (:class:`SharedPart`).

Layout: this rank's permuted tokens are sorted by global expert ``g = d * E + e`` (destination
rank ``d``, local expert ``e``, ``E`` experts per rank); ``send_counts[e][d]`` rows of
segment ``g`` go out in chunk ``e``; ``recv_counts[e][r]`` rows arrive from source rank ``r``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Work(Protocol):
    def wait(self) -> Any: ...


AllToAll = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], Work]
"""``exchange(output, input, output_splits, input_splits)``: an ASYNC all-to-all of rows
(``torch.distributed.all_to_all_single(..., async_op=True)`` on the EP group in production, a
thread rendezvous in the single-process tests); returns something to ``wait()`` on."""

RunExpert = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``run_expert(e, tokens, probs)``: local expert ``e`` on its rows (megatron's experts module
called with all other experts' token counts at 0)."""


@dataclass(frozen=True)
class SharedPart:
    """The shared experts as one piece of the pipeline: ``run(x)`` is their forward on ``x``
    (what megatron's dispatcher would run on its second stream), ``params`` the parameters it
    uses. Computed under the in-flight dispatch all-to-alls, with its graph kept inside the
    pipeline's node, so its backward runs under the in-flight gradient all-to-alls."""

    run: Callable[[torch.Tensor], torch.Tensor]
    params: tuple[torch.nn.Parameter, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """Row counts of one dispatch: ``send_counts[e][d]``, ``recv_counts[e][r]`` (see module doc)."""

    send_counts: tuple[tuple[int, ...], ...]
    recv_counts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_counts(
        cls, local_tokens_per_expert: Sequence[int], global_tokens_per_local_expert: Sequence[Sequence[int]]
    ) -> ChunkPlan:
        """``local_tokens_per_expert``: this rank's rows per GLOBAL expert (``ep * E`` values);
        ``global_tokens_per_local_expert[r][e]``: rows source rank ``r`` sends to local expert
        ``e`` of this rank (megatron's ``num_global_tokens_per_local_expert``)."""
        ranks = len(global_tokens_per_local_expert)
        experts = len(global_tokens_per_local_expert[0])
        if len(local_tokens_per_expert) != ranks * experts:
            raise ValueError(
                f"{len(local_tokens_per_expert)} global experts do not match {ranks} ranks x {experts} local experts"
            )
        send = tuple(tuple(int(local_tokens_per_expert[d * experts + e]) for d in range(ranks)) for e in range(experts))
        recv = tuple(tuple(int(global_tokens_per_local_expert[r][e]) for r in range(ranks)) for e in range(experts))
        return cls(send, recv)

    @property
    def chunks(self) -> int:
        return len(self.send_counts)

    @property
    def ranks(self) -> int:
        return len(self.send_counts[0])

    def segments(self) -> list[tuple[int, int, int]]:
        """``(chunk e, destination d, start row)`` of every segment of the permuted tokens, in
        row order (global expert order ``d * E + e``)."""
        out, start = [], 0
        for d in range(self.ranks):
            for e in range(self.chunks):
                out.append((e, d, start))
                start += self.send_counts[e][d]
        return out

    @property
    def local_rows(self) -> int:
        return sum(sum(counts) for counts in self.send_counts)

    def gather_chunk(self, tensor: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk ``chunk``'s rows of the permuted ``tensor`` (destination order): what it sends."""
        parts = [tensor.narrow(0, start, self.send_counts[e][d]) for e, d, start in self.segments() if e == chunk]
        return torch.cat(parts).contiguous()

    def scatter_chunks(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`gather_chunk` over all chunks: rows back in permuted order."""
        offsets = [0] * self.chunks
        parts = []
        for e, d, _ in self.segments():
            rows = self.send_counts[e][d]
            parts.append(chunks[e].narrow(0, offsets[e], rows))
            offsets[e] += rows
        return torch.cat(parts)


def _exchange(exchange: AllToAll, data: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]):
    output = data.new_empty((sum(out_splits), *data.shape[1:]))
    return output, exchange(output, data.contiguous(), list(out_splits), list(in_splits))


def run_forward(
    plan: ChunkPlan,
    exchange: AllToAll,
    run_expert: RunExpert,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    in_flight: Callable[[], Any] | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], Any]:
    """The forward pipeline; returns the combined rows (permuted order), per chunk
    ``(expert input, expert probs, expert output)`` (the graph a backward needs when run under
    grad mode with inputs that require grad), and what ``in_flight()`` returned: the work run
    while every dispatch all-to-all is on the link (the shared experts)."""
    dispatched = []
    for e in range(plan.chunks):  # every dispatch first: chunk e + 1 travels under expert e
        x, wx = _exchange(exchange, plan.gather_chunk(tokens, e), plan.recv_counts[e], plan.send_counts[e])
        p, wp = _exchange(exchange, plan.gather_chunk(probs, e), plan.recv_counts[e], plan.send_counts[e])
        dispatched.append((x, wx, p, wp))
    beside = in_flight() if in_flight is not None else None
    graphs, combined = [], []
    for e, (x, wx, p, wp) in enumerate(dispatched):
        wx.wait()
        wp.wait()
        x = x.detach().requires_grad_(tokens.requires_grad)
        p = p.detach().requires_grad_(probs.requires_grad)
        y = run_expert(e, x, p)
        graphs.append((x, p, y))
        combined.append(_exchange(exchange, y.detach(), plan.send_counts[e], plan.recv_counts[e]))
    for _, work in combined:
        work.wait()
    return plan.scatter_chunks([out for out, _ in combined]), graphs, beside


class OverlappedExperts(torch.autograd.Function):
    """dispatch all-to-all -> experts -> combine all-to-all as one autograd node, pipelined per
    chunk in forward and in backward.

    The experts' parameters are inputs of this node: their gradients are summed over the chunks
    here and returned once each, so megatron's DDP sees one gradient per parameter per backward
    (as without the feature; its overlap_grad_reduce bookkeeping refuses a second). Chunk ``f``
    gives expert ``e != f`` an exact zero gradient (no rows), so the sum is bitwise expert
    ``e``'s own gradient.
    """

    @staticmethod
    def forward(
        ctx,
        plan: ChunkPlan,
        exchange: AllToAll,
        run_expert: RunExpert,
        recompute: bool,
        shared: SharedPart | None,
        tokens,
        probs,
        shared_input,
        *params,
    ):
        # params: the experts' trainable parameters, then (with ``shared``) the shared experts'
        shared_graph: list = []

        def shared_forward() -> torch.Tensor:
            with torch.enable_grad():  # its graph stays inside this node (backward below)
                x = shared_input.detach().requires_grad_(shared_input.requires_grad)
                y = shared.run(x)
            shared_graph.extend((x, y))
            return y.detach()

        # recompute (moe-zero-memory): the experts run without a graph now; backward runs each
        # chunk's forward again from the kept dispatched rows (bitwise the same: same rows, same ops)
        with torch.set_grad_enabled(not recompute):
            out, graphs, shared_out = run_forward(
                plan, exchange, run_expert, tokens, probs, shared_forward if shared is not None else None
            )
        n_shared = len(shared.params) if shared is not None else 0
        ctx.shared_graph = tuple(shared_graph) or None
        ctx.shared_params = params[len(params) - n_shared :]
        params = params[: len(params) - n_shared]
        if recompute:  # saved through autograd (so saved-tensor hooks and meters see them)
            ctx.save_for_backward(*[t for x, p, _ in graphs for t in (x.detach(), p.detach())])
            graphs = None
        ctx.plan, ctx.exchange, ctx.graphs, ctx.params = plan, exchange, graphs, params
        ctx.run_expert, ctx.recompute = run_expert, recompute
        ctx.grad_flags = (tokens.requires_grad, probs.requires_grad)
        ctx.shapes = (tokens.shape, probs.shape)
        if shared is None:
            return out.detach()
        return out.detach(), shared_out

    @staticmethod
    def backward(ctx, grad_out, grad_shared=None):
        plan, exchange, graphs, params = ctx.plan, ctx.exchange, ctx.graphs, ctx.params
        ctx.graphs = None
        if ctx.recompute:
            saved = ctx.saved_tensors
            graphs = [(saved[2 * e], saved[2 * e + 1], None) for e in range(plan.chunks)]
        grad_out = grad_out.contiguous()
        # combine's gradient: every chunk's rows back to the experts' ranks, all issued first
        arriving = [
            _exchange(exchange, plan.gather_chunk(grad_out, e), plan.recv_counts[e], plan.send_counts[e])
            for e in range(plan.chunks)
        ]
        shared_grads = _shared_backward(ctx, grad_shared)  # under the gradient all-to-alls just issued
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        returning = []
        for e, (grad_y, work) in enumerate(arriving):
            work.wait()
            x, p, y = graphs[e]
            graphs[e] = None
            if ctx.recompute:
                x = x.requires_grad_(ctx.grad_flags[0])
                p = p.requires_grad_(ctx.grad_flags[1])
                with torch.enable_grad():
                    y = ctx.run_expert(e, x, p)
            inputs = [t for t in (x, p, *params) if t.requires_grad]
            if y.requires_grad and inputs:
                grads = torch.autograd.grad(y, inputs, grad_y, allow_unused=True)
            else:
                grads = [None] * len(inputs)
            by_input = dict(zip(map(id, inputs), grads))
            gx = by_input.get(id(x))
            gp = by_input.get(id(p))
            for i, param in enumerate(params):
                g = by_input.get(id(param))
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
            gx = torch.zeros_like(x) if gx is None else gx
            gp = torch.zeros_like(p) if gp is None else gp
            # the dispatch's gradient goes back under the next chunk's expert backward
            returning.append(
                (
                    _exchange(exchange, gx.detach(), plan.send_counts[e], plan.recv_counts[e]),
                    _exchange(exchange, gp.detach(), plan.send_counts[e], plan.recv_counts[e]),
                )
            )
        for (_, wx), (_, wp) in returning:
            wx.wait()
            wp.wait()
        grad_tokens = plan.scatter_chunks([gx for (gx, _), _ in returning]).view(ctx.shapes[0])
        grad_probs = plan.scatter_chunks([gp for _, (gp, _) in returning]).view(ctx.shapes[1])
        grad_shared_input, *grad_shared_params = shared_grads
        return (
            None,
            None,
            None,
            None,
            None,
            grad_tokens,
            grad_probs,
            grad_shared_input,
            *param_grads,
            *grad_shared_params,
        )


def _shared_backward(ctx, grad_shared: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The shared experts' input and parameter gradients (their graph was kept in forward)."""
    graph, params = ctx.shared_graph, ctx.shared_params
    ctx.shared_graph = None
    if graph is None:
        return [None]
    x, y = graph
    inputs = [t for t in (x, *params) if t.requires_grad]
    if grad_shared is None or not y.requires_grad or not inputs:
        return [None] * (1 + len(params))
    by_input = dict(zip(map(id, inputs), torch.autograd.grad(y, inputs, grad_shared, allow_unused=True)))
    return [by_input.get(id(t)) for t in (x, *params)]


def overlapped_experts(
    plan: ChunkPlan,
    exchange: AllToAll,
    run_expert: RunExpert,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    recompute: bool = False,
    shared: SharedPart | None = None,
    shared_input: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The experts' combined output for this rank's permuted ``tokens`` (rows in permuted order);
    with ``shared``, also the shared experts' output on ``shared_input`` (computed under the
    dispatch all-to-alls).

    With grad mode on, one :class:`OverlappedExperts` node (the pipeline also in backward);
    without it (inference, the first pass of an activation checkpoint) the forward pipeline
    only, keeping no graph. ``recompute``: keep only each chunk's dispatched rows and probs for
    backward and run the experts' forward again there (moe-zero-memory)."""
    if plan.local_rows != tokens.shape[0]:
        raise ValueError(f"the plan covers {plan.local_rows} rows, the dispatcher permuted {tokens.shape[0]}")
    if (shared is None) != (shared_input is None):
        raise ValueError("the shared experts need both their part and their input")
    trainable = [p for p in params if p.requires_grad]
    shared_trainable = [p for p in shared.params if p.requires_grad] if shared is not None else []
    needs_graph = tokens.requires_grad or probs.requires_grad or trainable or shared_trainable
    if torch.is_grad_enabled() and (needs_graph or (shared_input is not None and shared_input.requires_grad)):
        if shared is not None:
            shared = SharedPart(shared.run, tuple(shared_trainable))
        return OverlappedExperts.apply(
            plan, exchange, run_expert, recompute, shared, tokens, probs, shared_input, *trainable, *shared_trainable
        )
    in_flight = (lambda: shared.run(shared_input)) if shared is not None else None
    out, _, shared_out = run_forward(plan, exchange, run_expert, tokens, probs, in_flight)
    return out if shared is None else (out, shared_out)
