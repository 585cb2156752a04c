"""The prediction: for megatron's own path and for the features arm, every pipeline stage's
model state, activations (per layer, per microbatch, in flight) and process peak.

Ranks of one pipeline stage hold the same (TP, CP, DP and EP ranks differ only in which shard they
hold; MoE ranks in how many rows the router sends them, taken as balanced), so a stage stands for
``world / PP`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mindspeed_like.plan import activations, fsdp, params, peak, schedule, state
from mindspeed_like.plan.activations import Saved
from mindspeed_like.plan.paths import FEATURES, MEGATRON, Paths
from mindspeed_like.plan.recompute import apply_recompute, reforward_bytes
from mindspeed_like.plan.spec import Run, stage_layers


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (any of its ranks) in one arm."""

    index: int
    ranks: int
    layers: tuple[tuple[int, ...], ...]  # per model chunk
    state: tuple[state.Line, ...]
    chunk_rows: tuple[dict[str, list[Saved]], ...]  # one microbatch, per chunk: group -> rows
    in_flight: dict[int, int]  # chunk -> microbatches held
    measured_chunk: int  # the chunk of the rank's last forward (compare's activation probe)
    peak: peak.Peak
    # expert parallelism: one microbatch's activations (as activations_one_microbatch) on the rank whose
    # experts receive the most rows dropless routing can send them (routed_rows_bound); None without EP
    activations_largest_rank_bound: int | None = None

    def chunk_bytes(self, chunk: int) -> int:
        return sum(r.total for rows in self.chunk_rows[chunk].values() for r in rows)

    @property
    def activations_one_microbatch(self) -> int:
        """What compare's probe measures: one microbatch's forward of the last chunk run."""
        return self.chunk_bytes(self.measured_chunk)

    @property
    def activations_in_flight(self) -> int:
        return sum(self.chunk_bytes(c) * n for c, n in self.in_flight.items())

    def totals(self) -> dict[str, int]:
        return state.totals(list(self.state))

    def metrics(self) -> dict[str, int]:
        """compare's record rows, by their names, for this stage's ranks."""
        t = self.totals()
        return {
            "weights_bytes": t["weights"],
            "gradients_bytes": t["gradients"],
            "optimizer_bytes": t["optimizer"],
            "model_state_bytes": t["model_state"],
            "activations_bytes": self.activations_one_microbatch,
            "process_peak_bytes": self.peak.total,
        }


@dataclass(frozen=True)
class Arm:
    name: str
    paths: Paths
    stages: tuple[Stage, ...]

    def max_metric(self, name: str) -> int:
        return max(s.metrics()[name] for s in self.stages)


@dataclass(frozen=True)
class Prediction:
    run: Run
    megatron: Arm
    features: Arm
    enabled: tuple[str, ...] = ()  # the accelerations switched on in the features arm
    idle: tuple[str, ...] = ()  # switched on, but nothing in this model changes memory with them
    notes: tuple[str, ...] = field(default_factory=tuple)

    def arms(self) -> tuple[Arm, Arm]:
        return self.megatron, self.features


def predict_arm(run: Run, name: str, paths: Paths) -> Arm:
    lay = run.layout
    split = stage_layers(run.model, lay)
    stages = []
    for s in range(lay.pp):
        chunk_params = params.stage(run, s)
        lines = state.model_state(run, chunk_params, paths)
        rows = []
        reforward = 0
        for c, layers in enumerate(split[s]):
            first = s == 0 and c == 0
            last = s == lay.pp - 1 and c == lay.chunks - 1
            groups = activations.chunk(run, paths, layers, first, last)
            kept = fsdp.saved_gathered_bytes(run, chunk_params[c], paths)
            if kept:
                groups["FSDP"] = [
                    activations.Saved("fsdp", f"{unit}: gathered parameters kept from forward to backward", size)
                    for unit, size in kept
                ]
            rows.append(apply_recompute(run, groups, layers))
            reforward = max(reforward, reforward_bytes(groups, rows[-1], layers))
        weights = [sum(r.total for group in chunk.values() for r in group) for chunk in rows]
        group = lay.microbatch_group
        in_flight = schedule.in_flight_chunks(lay.pp, s, lay.chunks, lay.num_microbatches, group, weights)
        measured = schedule.last_forward_chunk(lay.pp, lay.chunks, lay.num_microbatches, group)
        gathered = fsdp.in_flight_bytes(run, chunk_params, paths) if lay.fsdp else (0, "")
        stage_peak = peak.estimate(run, paths, lines, rows, in_flight, name, s, reforward, gathered)
        bound = None
        factor = routed_rows_bound(run)
        if factor is not None:
            c = measured
            worst = replace(run, moe_rows_factor=factor)
            groups = activations.chunk(
                worst, paths, split[s][c], s == 0 and c == 0, s == lay.pp - 1 and c == lay.chunks - 1
            )
            bound = sum(r.total for rows_ in apply_recompute(worst, groups, split[s][c]).values() for r in rows_)
            bound += sum(r.total for r in rows[c].get("FSDP", []))
        stages.append(
            Stage(
                index=s,
                ranks=lay.world_size // lay.pp,
                layers=tuple(split[s]),
                state=tuple(lines),
                chunk_rows=tuple(rows),
                in_flight=in_flight,
                measured_chunk=measured,
                peak=stage_peak,
                activations_largest_rank_bound=bound,
            )
        )
    return Arm(name, paths, tuple(stages))


def routed_rows_bound(run: Run) -> float | None:
    """The most rows an expert-parallel rank's experts can receive, as a multiple of the balanced
    share the plan's activations assume (``t x top-k`` rows, the mean over the ranks), under dropless
    routing (megatron's default: no --moe-expert-capacity-factor, no token dropped). Every token picks
    top-k distinct experts, so it sends a rank at most min(top-k, the rank's local experts) rows, and
    the dispatcher brings a rank the tokens of its EP group's ranks (EP x t): at most
    ``EP x t x min(k, E / EP)`` rows, ``EP x min(k, E / EP) / k`` times the mean. The bound is
    reached only if the router sends every token of the group to one rank's experts; it is what a
    user who must never run out sizes for. None without expert parallelism (one rank holds every
    expert: it receives all t x k rows, the plan's own figure)."""
    m, lay = run.model, run.layout
    if not m.is_moe or lay.ep == 1:
        return None
    local = m.num_experts // lay.ep
    k = m.moe_router_topk
    return lay.ep * min(k, local) / k


def predict(run: Run, feature_paths: Paths, enabled: tuple[str, ...] = (), notes: tuple[str, ...] = ()) -> Prediction:
    """Both arms of ``run``: megatron's own path and the features arm's ``feature_paths``."""
    from mindspeed_like.plan.paths import megatron_paths

    megatron = predict_arm(run, MEGATRON, megatron_paths())
    features = predict_arm(run, FEATURES, feature_paths)
    idle = tuple(name for name in enabled if name not in acting_features(features))
    return Prediction(run, megatron, features, enabled, idle, notes)


def acting_features(arm: Arm) -> set[str]:
    """The features that change at least one row of this arm's prediction."""
    names: set[str] = set()
    for stage in arm.stages:
        names.update(line.feature for line in stage.state if line.feature)
        for groups in stage.chunk_rows:
            names.update(r.feature for rows in groups.values() for r in rows if r.feature)
        names.update(stage.peak.features)
    return names
