"""A step-time model for ranking the configurations `--fit` finds, calibrated by results/.

    step = model FLOPs a step / ranks / achieved FLOP/s of a rank        (megatron's own path)
           x (1 + recomputed forward FLOPs / model FLOPs)                 (megatron's recompute)
           x (1 + (PP - 1) / (microbatches x virtual stages))             (the pipeline bubble)
           x the features' time ratio

- achieved FLOP/s of a rank: the median of megatron's arm over the compare records of the target
  device (``model_flops_per_s`` / ranks; preferring records of the same preset);
- the features' ratio: a level's measured step-time ratio (features / megatron, median over the
  compare records of that level on the device, the same preset preferred); for individual features
  their benchmarks' ratios: fused-linear-cross-entropy's ``time_ratio`` on the output layer's share of
  the FLOPs (linear_cross_entropy record), recompute-activation-function's (recompute_activation
  record), moe-zero-memory one more expert forward (a third of the experts' share);
- megatron's recompute: ``full`` one more forward of the recomputed layers (a third of their
  share), selective ``core_attn`` one more attention core forward.

Where no record of the device exists the figure says so (``source``) and a stated default is used
(accelerators: 40% of an H100's 989 TFLOP/s bf16 peak; feature ratios 1.0). Timings on a CPU are
a proxy for nothing but this CPU.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from typing import Any

from mindspeed_like.plan.paths import Paths
from mindspeed_like.plan.spec import Run
from mindspeed_like.toolkit import records

DEFAULT_ACCELERATOR_FLOPS = 0.4 * 989e12
# Link bandwidths the layout's communication is charged at (assumed, not measured here: no
# multi-GPU record exists): within a node (a group of at most 8 ranks), across nodes per GPU.
INTRA_NODE_BYTES_PER_S = 300e9
INTER_NODE_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class Calibration:
    device: str
    flops_per_s: float
    flops_source: str
    level_ratio: dict[int, float] = field(default_factory=dict)
    level_source: dict[int, str] = field(default_factory=dict)
    lce_ratio: float = 1.0
    act_recompute_ratio: float = 1.0
    notes: tuple[str, ...] = ()


def _compare_records(device: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(records.results_dir().glob("compare-*.json")):
        rec = records.read(path)
        if rec.get("host", {}).get("device", "cpu") != device or "plan-baseline" in path.stem:
            continue
        out.append(rec)
    return out


def _row(rec: dict[str, Any], metric: str) -> dict[str, Any] | None:
    return next((r for r in rec["rows"] if r.get("metric") == metric), None)


@functools.lru_cache(maxsize=64)
def calibrate(device: str, preset: str | None = None, flops_per_step: float | None = None) -> Calibration:
    """The device's figures from results/: achieved FLOP/s of the compare record nearest in model
    FLOPs a step (same preset preferred), each level's median step-time ratio."""
    import math

    recs = _compare_records(device)
    same = [r for r in recs if r["options"].get("preset") == preset] or recs
    measured = []
    for rec in same:
        row = _row(rec, "model_flops_per_s")
        per_step = rec.get("extra", {}).get("model_flops_per_step")
        if row and row.get("megatron") and per_step:
            measured.append((per_step, row["megatron"] / rec["options"].get("world_size", 1), rec["name"]))
    notes = []
    if measured:
        target = flops_per_step or statistics.median(m[0] for m in measured)
        per_step, flops, name = min(measured, key=lambda m: abs(math.log(m[0] / target)))
        source = f"megatron's FLOP/s a rank in {name}, the nearest {device} compare record in FLOPs a step"
    else:
        flops = DEFAULT_ACCELERATOR_FLOPS if device != "cpu" else 1e9
        source = f"no compare record on {device}: assumed {flops / 1e12:.0f} TFLOP/s a rank"
        notes.append(source)
    ratios: dict[int, list[float]] = {}
    for rec in recs:
        level = (rec["options"].get("flags") or {}).get("optimization_level")
        row = _row(rec, "step_time_s")
        if level is None or not row or not row.get("ratio"):
            continue
        if (
            preset
            and rec["options"].get("preset") != preset
            and any(r["options"].get("preset") == preset for r in recs)
        ):
            continue
        ratios.setdefault(int(level), []).append(row["ratio"])
    level_ratio = {level: statistics.median(values) for level, values in ratios.items()}
    level_source = {level: f"median of {len(values)} compare record(s)" for level, values in ratios.items()}
    return Calibration(
        device=device,
        flops_per_s=flops,
        flops_source=source,
        level_ratio={0: 1.0, **level_ratio},
        level_source={0: "megatron's own path", **level_source},
        lce_ratio=_benchmark_median("linear_cross_entropy", "time_ratio", device),
        act_recompute_ratio=_benchmark_median("recompute_activation", "time_ratio", device),
        notes=tuple(notes),
    )


def _benchmark_median(name: str, field_name: str, device: str) -> float:
    path = records.results_dir() / f"{records.device_record_name(name, device)}.json"
    if not path.exists():
        return 1.0
    values = [row[field_name] for row in records.read(path)["rows"] if isinstance(row.get(field_name), (int, float))]
    return statistics.median(values) if values else 1.0


def flops_model(run: Run):
    """compare/flops.py's count for this run's shapes."""
    from mindspeed_like.compare.flops import model_flops

    m = run.model
    args = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length,
        vocab_size=m.vocab_size,
        gated_linear_unit=m.gated_linear_unit,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        num_query_groups=m.num_query_groups,
        multi_latent_attention=m.multi_latent_attention,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        num_moe_experts=m.num_experts or None,
        moe_layer_freq=list(m.moe_layer_pattern) if m.is_moe else 1,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_topk=m.moe_router_topk,
        mtp_num_layers=m.mtp_num_layers,
    )
    return model_flops(args)


@dataclass(frozen=True)
class StepTime:
    seconds: float
    factors: dict[str, float]  # name -> multiplier (the why of the figure)


def step_time(run: Run, cal: Calibration, *, level: int | None = None, paths: Paths | None = None) -> StepTime:
    """Predicted step time of ``run``: megatron's path (``level`` 0 / no paths), a level, or the
    individual features of ``paths``."""
    lay = run.layout
    counted = flops_model(run)
    sequences = lay.micro_batch_size * lay.num_microbatches * lay.dp
    base = counted.per_step(sequences) / lay.world_size / cal.flops_per_s
    factors: dict[str, float] = {}
    per_token = counted.per_token * run.model.seq_length + counted.per_sequence
    rc = run.recompute
    if rc.granularity == "full":
        layers_share = 1 - counted.parts.get("output layer", 0) * run.model.seq_length / per_token
        per_chunk = run.model.num_layers // (lay.pp * lay.chunks)
        recomputed = 1.0 if rc.method != "block" else min(1.0, (rc.num_layers or 0) / max(1, per_chunk))
        factors["megatron full recompute (one more forward)"] = 1 + layers_share * recomputed / 3
    elif rc.granularity == "selective" and "core_attn" in rc.modules:
        factors["megatron selective recompute (attention core forward again)"] = (
            1 + counted.per_sequence / per_token / 3
        )
    if lay.pp > 1:
        factors["pipeline bubble"] = 1 + (lay.pp - 1) / (lay.num_microbatches * lay.chunks)
    if level is not None and level > 0:
        ratio = cal.level_ratio.get(level)
        if ratio is not None:
            factors[f"level {level} (measured ratio, {cal.level_source[level]})"] = ratio
    elif paths is not None:
        head_share = counted.parts.get("output layer", 0) * run.model.seq_length / per_token
        if paths.fused_linear_cross_entropy:
            factors["fused-linear-cross-entropy (benchmark ratio on the output layer's share)"] = 1 + head_share * (
                cal.lce_ratio - 1
            )
        if paths.recompute_activation:
            factors["recompute-activation-function (benchmark ratio)"] = cal.act_recompute_ratio
        if paths.moe_zero_memory:
            expert_share = (
                counted.parts.get("MoE router + routed top-k + shared experts", 0) * run.model.seq_length / per_token
            )
            factors["moe-zero-memory (experts' forward again)"] = 1 + expert_share / 3
    seconds = base
    for value in factors.values():
        seconds *= value
    comm = communication_seconds(run)
    if comm:
        factors["TP / CP / EP communication (assumed link bandwidths, not overlapped)"] = (seconds + comm) / seconds
        seconds += comm
    return StepTime(seconds, factors)


def _bandwidth(group: int) -> float:
    return INTRA_NODE_BYTES_PER_S if group <= 8 else INTER_NODE_BYTES_PER_S


def communication_seconds(run: Run) -> float:
    """Per step and rank: TP's 8 collectives of the layer's activations per layer and microbatch
    (forward and backward, with or without SP), CP's ring of k/v blocks (forward, and twice in
    backward), EP's dispatch and combine all-to-alls (forward and backward). DP's gradient reduction
    is taken as overlapped with the backward (megatron's --overlap-grad-reduce); PP's sends are
    one activation per microbatch (not counted)."""
    m, lay = run.model, run.layout
    p = 2 if run.precision.params != "fp32" else 4
    tokens = lay.micro_batch_size * m.seq_length // lay.cp
    layers = m.num_layers // lay.pp
    per_microbatch = 0.0
    if lay.tp > 1:
        per_microbatch += 8 * (lay.tp - 1) / lay.tp * tokens * m.hidden_size * p / _bandwidth(lay.tp) * layers
    if lay.cp > 1:
        kv = 2 * tokens * max(1, m.num_query_groups // lay.tp) * m.kv_channels * p
        per_microbatch += 3 * (lay.cp - 1) * kv / _bandwidth(lay.tp * lay.cp) * layers
    if m.is_moe and lay.ep > 1:
        moe_layers = sum(m.moe_layer_pattern) / max(1, lay.pp)
        routed = tokens * m.moe_router_topk * m.hidden_size * p
        per_microbatch += 4 * (lay.ep - 1) / lay.ep * routed / _bandwidth(lay.ep * lay.expert_tp) * moe_layers
    return per_microbatch * lay.num_microbatches
