"""The plan as a table per pipeline stage (text) or as JSON with compare's metric names."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from mindspeed_like.plan.predict import Arm, Prediction, Stage
from mindspeed_like.plan.spec import Run

GIB = 2**30
MIB = 2**20
METRICS = (
    "weights_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "model_state_bytes",
    "activations_bytes",
    "process_peak_bytes",
)


def size(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:,.2f} GiB"
    return f"{n / MIB:,.1f} MiB"


def as_given(budget: int) -> str:
    """`` (--device-memory 80GB: decimal)`` where the budget came from plan's command line (cli's
    MemorySize says how it was written), else ''."""
    said = getattr(budget, "said", "")
    return f" ({said})" if said else ""


def describe(run: Run) -> list[str]:
    m, lay = run.model, run.layout
    kind = []
    if m.multi_latent_attention:
        kind.append("MLA")
    if m.is_moe:
        dense = len(m.moe_layer_pattern) - sum(m.moe_layer_pattern)
        kind.append(
            f"MoE {m.num_experts} experts top-{m.moe_router_topk}" + (f", {dense} dense layers" if dense else "")
        )
        if m.moe_shared_expert_intermediate_size:
            kind.append("shared expert")
    if m.mtp_num_layers:
        kind.append(f"{m.mtp_num_layers} MTP layer(s)")
    groups = (
        f" ({m.num_query_groups} query groups)"
        if m.num_query_groups != m.num_attention_heads and not m.multi_latent_attention
        else ""
    )
    model = (
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads{groups}, ffn "
        f"{m.ffn_hidden_size}, seq {m.seq_length}, vocab {m.vocab_size} (padded), {m.normalization}, "
        f"{'SwiGLU' if m.gated_linear_unit else 'GELU'}, {'tied' if m.tied_embeddings else 'untied'} embeddings"
        + (f"; {', '.join(kind)}" if kind else "")
    )
    vpp = f" x {lay.vpp} virtual" if lay.vpp else ""
    layout = (
        f"layout: {lay.world_size} ranks = TP {lay.tp}{' + SP' if lay.sequence_parallel else ''} x PP {lay.pp}{vpp} x "
        f"CP {lay.cp} x DP {lay.dp}"
        + (f", EP {lay.ep}" if m.is_moe else "")
        + (f", expert TP {lay.etp}" if m.is_moe and lay.etp is not None and lay.etp != lay.tp else "")
        + f"; micro-batch {lay.micro_batch_size}, {lay.num_microbatches} microbatch(es) a step per DP rank; "
        + (
            _fsdp_text(run)
            or (
                "distributed optimizer"
                if lay.distributed_optimizer
                else f"{'FP32' if run.precision.params == 'fp32' else 'Float16'} optimizer (no optimizer sharding)"
            )
        )
    )
    p = run.precision
    grads = f"{p.grad_dtype} gradients"
    if lay.fsdp == "megatron_fsdp":
        from mindspeed_like.plan import fsdp

        copy = fsdp.megatron_fsdp_grad_copy_dtype(p)
        main = fsdp.megatron_fsdp_main_params_dtype(p)
        grads = (
            f"{fsdp.megatron_fsdp_grad_dtype(p)} gradients"
            + (f" (and {'an' if copy[0] == 'f' else 'a'} {copy} copy of the shard for the masters)" if copy else "")
            + (f", {main} masters" if main else ", no main-weight buffer (the optimizer steps the weights' shard)")
        )
    precision = f"precision: {p.params} parameters, {grads}"
    if p.precision_aware_optimizer:
        precision += (
            f", precision-aware optimizer (exp_avg {p.exp_avg}, exp_avg_sq {p.exp_avg_sq}, master {p.main_params})"
        )
    rc = run.recompute
    if rc.granularity:
        precision += f"; megatron recompute {rc.granularity}" + (
            f" {rc.method} {rc.num_layers}" if rc.granularity == "full" else f" ({', '.join(rc.modules)})"
        )
    impl = "TE spec on the te-backend" if run.transformer_impl == "transformer_engine" else "local spec"
    return [model, layout, precision + f"; {impl}; device {run.device}"]


def _fsdp_text(run: Run) -> str:
    lay = run.layout
    if lay.fsdp == "torch_fsdp2":
        return (
            "torch FSDP2 ("
            + ("reshard after forward" if lay.reshard_after_forward else "no reshard after forward")
            + ")"
        )
    if lay.fsdp == "megatron_fsdp":
        if lay.optimizer_instances > 1:
            outer = ", masters and moments sharded across them" if lay.outer_sharding == "optim" else ""
            return (
                f"Megatron-FSDP ({lay.sharding_strategy}; HSDP: {lay.optimizer_instances} instances of "
                f"{lay.dp * lay.cp // lay.optimizer_instances} ranks{outer})"
            )
        return f"Megatron-FSDP ({lay.sharding_strategy})"
    return ""


def read_by(run: Run) -> str:
    """Which parser read the arguments (the JSON's ``run.source``), in words."""
    return {
        "megatron-lm": "Megatron-LM's parser and validate_args",
        "builtin": "the built-in parser (Megatron-LM's model and layout options; megatron.training not used)",
        "compare": "mindspeed-like compare's options",
        "megatron-lm parser, built-in derivations": "Megatron-LM's parser, the built-in derivations (see the note)",
    }.get(run.source, run.source)


def schedule_text(run: Run, stage: Stage) -> str:
    lay = run.layout
    if lay.pp == 1:
        return "no pipeline: one microbatch at a time"
    if lay.vpp:
        held = ", ".join(f"chunk {c}: {n}" for c, n in stage.in_flight.items())
        return f"interleaved schedule, microbatches in flight per model chunk: {held}"
    return f"1F1B: {stage.in_flight[0]} microbatch(es) in flight (PP - stage)"


def layer_summary(stage: Stage, chunk: int) -> list[tuple[str, int]]:
    """Activation bytes of one microbatch per kind of group (embedding, dense / MoE layer, head)."""
    kinds: dict[str, list[int]] = defaultdict(list)
    for group, rows in stage.chunk_rows[chunk].items():
        total = sum(r.total for r in rows)
        kinds[group.split(" ")[0] if not group.startswith("layer") else "layer"].append(total)
    out = []
    for kind, values in kinds.items():
        if kind == "layer":
            distinct = sorted(set(values))
            for v in distinct:
                out.append((f"per layer ({values.count(v)} layer{'s' if values.count(v) > 1 else ''})", v))
        else:
            out.append((kind, sum(values)))
    return out


def text(pred: Prediction, switches_line: str, verbose: bool = False) -> str:
    run = pred.run
    lines = ["mindspeed-like plan", *("  " + line for line in describe(run))]
    lines += ["  arguments read by: " + read_by(run), "  " + switches_line]
    if run.not_modeled:
        lines.append("  options read but not modeled (they may change memory): " + ", ".join(run.not_modeled))
    if pred.idle:
        lines.append("  switched on, no memory effect on this model: " + ", ".join(pred.idle))
    for note in pred.notes:
        lines.append("  note: " + note)
    for s_meg, s_feat in zip(pred.megatron.stages, pred.features.stages):
        lines.append("")
        lines.append(
            f"pipeline stage {s_meg.index} ({s_meg.ranks} ranks; layers {_layers(s_meg)}): {schedule_text(run, s_meg)}"
        )
        rows = _stage_rows(s_meg, s_feat)
        width = max(len(r[0]) for r in rows)
        lines.append(f"  {'per rank'.ljust(width)}  {'megatron':>12}  {'features':>12}  {'saved':>12}")
        for label, a, b in rows:
            saved = "" if a is None or b is None else size(a - b)
            lines.append(f"  {label.ljust(width)}  {_cell(a):>12}  {_cell(b):>12}  {saved:>12}")
        lines.append(
            f"  largest temporary: megatron {size(s_meg.peak.temporary)} ({s_meg.peak.temporary_what}); "
            f"features {size(s_feat.peak.temporary)} ({s_feat.peak.temporary_what}); peak phase: "
            f"{s_meg.peak.phase} / {s_feat.peak.phase}"
        )
        if s_meg.peak.gathered_what:
            lines.append(f"  FSDP: unsharded units in flight: {s_meg.peak.gathered_what}")
        if verbose:
            lines += _rows_detail(s_meg, "megatron") + _rows_detail(s_feat, "features")
    lines.append("")
    lines += share_lines(pred)
    return "\n".join(lines)


def _layers(stage: Stage) -> str:
    parts = []
    for layers in stage.layers:
        parts.append(f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else (str(layers[0]) if layers else "none"))
    return " + ".join(parts)


def _cell(value: int | None) -> str:
    return "" if value is None else size(value)


def _stage_rows(meg: Stage, feat: Stage) -> list[tuple[str, int | None, int | None]]:
    tm, tf = meg.totals(), feat.totals()
    rows: list[tuple[str, int | None, int | None]] = [
        ("weights", tm["weights"], tf["weights"]),
        ("gradients", tm["gradients"], tf["gradients"]),
        ("optimizer state", tm["optimizer"], tf["optimizer"]),
        ("model state", tm["model_state"], tf["model_state"]),
    ]
    chunk = meg.measured_chunk
    labels = dict(layer_summary(meg, chunk))
    feat_labels = dict(layer_summary(feat, chunk))
    for label in labels:
        rows.append((f"activations {label}", labels[label], feat_labels.get(label)))
    rows += [
        ("activations, one microbatch", meg.activations_one_microbatch, feat.activations_one_microbatch),
        ("activations in flight", meg.activations_in_flight, feat.activations_in_flight),
    ]
    if meg.activations_largest_rank_bound is not None:
        rows.append(
            (
                "activations, one microbatch, largest EP rank (bound)",
                meg.activations_largest_rank_bound,
                feat.activations_largest_rank_bound,
            )
        )
    head_m, head_f = _head(meg), _head(feat)
    if head_m is not None:
        rows.append(("logits / loss (saved, one microbatch)", head_m, head_f))
    if meg.peak.runtime:
        rows.append(("process runtime (CPU host)", meg.peak.runtime, feat.peak.runtime))
    if meg.peak.build or feat.peak.build:
        rows.append(("model build's own peak (CPU host; not added: a phase)", meg.peak.build, feat.peak.build))
    if meg.peak.buffers or feat.peak.buffers:
        rows.append(("buffers (attention scores, cuBLAS workspaces)", meg.peak.buffers, feat.peak.buffers))
    if meg.peak.gathered or feat.peak.gathered:
        rows.append(("FSDP: unsharded units in flight (below)", meg.peak.gathered, feat.peak.gathered))
    if meg.peak.kernels or feat.peak.kernels:
        rows.append(("experts' GEMM kernels (CPU host, oneDNN)", meg.peak.kernels, feat.peak.kernels))
    rows.append(("process peak", meg.peak.total, feat.peak.total))
    return rows


def _head(stage: Stage) -> int | None:
    for groups in stage.chunk_rows:
        if "head" in groups:
            return sum(r.total for r in groups["head"] if r.component == "loss")
    return None


def _rows_detail(stage: Stage, name: str) -> list[str]:
    out = [f"  {name}: saved for backward, one microbatch of chunk {stage.measured_chunk}:"]
    for group, rows in stage.chunk_rows[stage.measured_chunk].items():
        for r in rows:
            tag = f" [{r.feature}]" if r.feature else ""
            count = f"{r.count} x" if r.count > 1 else ""
            out.append(f"    {group:10s} {count:>5} {size(r.bytes):>12}  {r.what}{tag}")
    for line in stage.state:
        tag = f" [{line.feature}]" if line.feature else ""
        out.append(f"    {line.kind:10s} {size(line.bytes):>12}  {line.what}{tag}")
    return out


def feature_shares(pred: Prediction) -> dict[str, int]:
    """What each switched-on feature saves at the peak stage: the features arm's peak without that
    feature minus with it (one at a time; shares of features that act on the same bytes overlap)."""
    import dataclasses

    from mindspeed_like.plan.predict import predict_arm

    run, paths = pred.run, pred.features.paths
    base = max(s.peak.total for s in pred.features.stages)
    shares = {}
    for field, name in _PATH_FEATURES.items():
        if not getattr(paths, field):
            continue
        without = predict_arm(run, "features", dataclasses.replace(paths, **{field: False}))
        shares[name] = max(s.peak.total for s in without.stages) - base
    return shares


_PATH_FEATURES = {
    "fused_rmsnorm": "fused-rmsnorm",
    "fused_rope": "fused-rotary-pos-emb",
    "flash_attention": "flash-attention",
    "fused_swiglu": "fused-swiglu",
    "recompute_activation": "recompute-activation-function",
    "fused_linear_cross_entropy": "fused-linear-cross-entropy",
    "moe_zero_memory": "moe-zero-memory",
    "fused_permute": "moe-permute",
    "fused_router": "moe-router",
    "reuse_fp32_param": "reuse-fp32-param",
    "precision_aware_portable": "precision-aware-optimizer",
    "host_allocator": "host-allocator",  # a cost on a CPU host (negative): it keeps freed blocks
}


def share_lines(pred: Prediction) -> list[str]:
    shares = feature_shares(pred)
    meg = max(s.peak.total for s in pred.megatron.stages)
    feat = max(s.peak.total for s in pred.features.stages)
    out = [f"peak per rank (largest stage): megatron {size(meg)}, features {size(feat)} ({size(meg - feat)} less)"]
    if shares:
        out.append("each feature's share of it (the features' peak without it, minus with it):")
        for name, value in sorted(shares.items(), key=lambda kv: -kv[1]):
            if name not in pred.idle:  # said above: no memory effect on this model
                out.append(f"  {name:32s} {size(value):>12}")
    return out


def as_json(pred: Prediction, extra: dict[str, Any]) -> dict[str, Any]:
    run = pred.run
    lay = run.layout
    per_stage = lay.world_size // lay.pp
    stages = []
    for s_meg, s_feat in zip(pred.megatron.stages, pred.features.stages):
        stages.append(
            {
                "pipeline_stage": s_meg.index,
                "ranks": list(_ranks_of_stage(run, s_meg.index)),
                "layers": [list(layers) for layers in s_meg.layers],
                "microbatches_in_flight": {str(c): n for c, n in s_meg.in_flight.items()},
                "megatron": _arm_json(s_meg),
                "features": _arm_json(s_feat),
            }
        )
    return {
        "schema": 1,
        "run": {
            "description": describe(run),
            "source": run.source,
            "world_size": lay.world_size,
            "ranks_per_stage": per_stage,
        },
        **extra,
        "per_rank": stages,
        "peak": {arm.name: max(s.peak.total for s in arm.stages) for arm in pred.arms()},
        "feature_shares_bytes": feature_shares(pred),
        "not_modeled": list(run.not_modeled),
        "notes": list(pred.notes),
        "idle_features": list(pred.idle),
    }


def _arm_json(stage: Stage) -> dict[str, Any]:
    out: dict[str, Any] = dict(stage.metrics())
    out.update(
        activations_in_flight_bytes=stage.activations_in_flight,
        largest_temporary_bytes=stage.peak.temporary,
        largest_temporary=stage.peak.temporary_what,
        runtime_bytes=stage.peak.runtime,
        build_peak_bytes=stage.peak.build,
        host_kernel_bytes=stage.peak.kernels,
        buffer_bytes=stage.peak.buffers,
        peak_phase=stage.peak.phase,
        fsdp_in_flight_bytes=stage.peak.gathered,
        fsdp_in_flight=stage.peak.gathered_what,
        activations_largest_rank_bound_bytes=stage.activations_largest_rank_bound,
        activations_per_group_bytes={
            group: sum(r.total for r in rows) for group, rows in stage.chunk_rows[stage.measured_chunk].items()
        },
    )
    head = _head(stage)
    if head is not None:
        out["logits_loss_bytes"] = head
    return out


def _ranks_of_stage(run: Run, stage: int) -> range:
    """megatron's default order (tp-cp-ep-dp-pp): pipeline stage = rank // (TP x CP x DP)."""
    per = run.layout.world_size // run.layout.pp
    return range(stage * per, (stage + 1) * per)


def arm_max(arm: Arm, metric: str) -> int:
    return max(s.metrics()[metric] for s in arm.stages)
