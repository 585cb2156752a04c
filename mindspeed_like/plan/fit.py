"""`--fit`: the configuration that fits the device with the least predicted step time.

Searched (every combination; each is arithmetic, no model is built):

- the features: ``--optimization-level`` 0 (megatron's own path), 1, 2;
- with a Megatron-LM command line also megatron's recompute (none, ``selective``, ``full uniform
  1``), the micro-batch size (the given one and its halvings, the global batch kept), and with
  ``--world-size`` the layout: TP (dividing heads and query groups, up to 8), PP (dividing the
  layers), CP (dividing the sequence in 2 x CP chunks), EP (dividing the experts), DP the rest, the
  distributed optimizer where DP > 1, sequence parallelism where TP > 1;
- with `mindspeed-like compare`'s options only the level (compare runs the given layout).

A configuration fits when its largest rank's predicted peak is at most ``--device-memory`` less
``--headroom`` (5% by default: a CPU host's resident set varied by about that much between identical
runs; on a GPU the CUDA context and communication buffers are not in the allocator's peak); among
those the fastest by :mod:`timing` wins. The answer is a ready command line, the predicted peak per
pipeline stage, and why each choice was made (the alternatives one step away: over budget by how
much, or slower by how much). When nothing fits: the leanest configuration and what is short.
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan import features, timing
from mindspeed_like.plan.paths import megatron_paths
from mindspeed_like.plan.predict import predict_arm
from mindspeed_like.plan.report import as_given, size
from mindspeed_like.plan.spec import Layout, Recompute, Run
from mindspeed_like.toolkit.errors import ConfigError

LEVELS = (0, 1, 2)
RECOMPUTES = (Recompute(), Recompute("selective", None, None, ("core_attn",)), Recompute("full", "uniform", 1))


@dataclass(frozen=True)
class Candidate:
    level: int
    recompute: Recompute
    layout: Layout
    peaks: tuple[int, ...]  # per pipeline stage
    seconds: float
    factors: dict[str, float]

    @property
    def peak(self) -> int:
        return max(self.peaks)

    def key(self) -> tuple:
        lay = self.layout
        return (self.level, self.recompute.granularity, lay.micro_batch_size, lay.tp, lay.pp, lay.cp, lay.ep)


@dataclass(frozen=True)
class FitResult:
    run: Run
    budget: int
    best: Candidate | None
    leanest: Candidate
    tried: int
    usable: int
    reasons: tuple[str, ...]
    command: str
    calibration: timing.Calibration


def _levels() -> dict[int, features.Switches]:
    return {level: features.resolve(values={"optimization_level": level}) for level in LEVELS}


def _layouts(run: Run, world: int | None) -> list[Layout]:
    lay, m = run.layout, run.model
    global_batch = lay.micro_batch_size * lay.num_microbatches * lay.dp
    compare = run.source == "compare"
    mbs_options = (
        [lay.micro_batch_size]
        if compare
        else sorted({lay.micro_batch_size >> i for i in range(4) if lay.micro_batch_size >> i >= 1})
    )
    if world is None or compare:
        shapes = [(lay.tp, lay.pp, lay.cp, lay.ep)]
        world = lay.world_size
    else:
        tps = [
            t
            for t in (1, 2, 4, 8)
            if m.num_attention_heads % t == 0
            and (m.multi_latent_attention or m.num_query_groups % t == 0)
            and m.ffn_hidden_size % t == 0
        ]
        pps = [p for p in range(1, m.num_layers + 1) if m.num_layers % p == 0 and p <= 16]
        cps = [c for c in (1, 2, 4, 8) if m.seq_length % (2 * c) == 0 or c == 1]
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if m.is_moe and m.num_experts % e == 0] or [1]
        if lay.fsdp == "torch_fsdp2":
            pps, eps = [1], [1]  # Megatron-LM refuses FSDP2 with pipeline or expert parallelism
        shapes = list(itertools.product(tps, pps, cps, eps))
    out = []
    for (tp, pp, cp, ep), mbs in itertools.product(shapes, mbs_options):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        if global_batch % (mbs * dp) or (dp * cp * tp) % (tp * ep):
            continue
        micro = global_batch // (mbs * dp)
        if compare:
            out.append(dataclasses.replace(lay, micro_batch_size=mbs))
            continue
        out.append(
            dataclasses.replace(
                lay,
                tp=tp,
                pp=pp,
                cp=cp,
                ep=ep,
                dp=dp,
                micro_batch_size=mbs,
                num_microbatches=micro,
                sequence_parallel=tp > 1,
                # the FSDP paths shard by themselves (FSDP2 refuses the distributed optimizer; Megatron-FSDP's is
                # its own, given by --use-megatron-fsdp)
                distributed_optimizer=lay.distributed_optimizer if lay.fsdp else lay.distributed_optimizer or dp > 1,
                vpp=lay.vpp if pp == lay.pp else None,
            )
        )
    return out


DEFAULT_HEADROOM = 0.05


def fit(
    run: Run, switches: features.Switches, budget: int, world: int | None, headroom: float = DEFAULT_HEADROOM
) -> FitResult:
    """The fastest configuration whose predicted peak is within ``(1 - headroom) x budget``."""
    levels = _levels()
    counted = timing.flops_model(run)
    sequences = run.layout.micro_batch_size * run.layout.num_microbatches * run.layout.dp
    cal = timing.calibrate(run.device, _preset(run), counted.per_step(sequences))
    recomputes = (run.recompute,) if run.source == "compare" else RECOMPUTES
    candidates: list[Candidate] = []
    for layout, rc, level in itertools.product(_layouts(run, world), recomputes, LEVELS):
        trial = dataclasses.replace(run, layout=layout, recompute=rc)
        if layout.tp != run.layout.tp:
            trial = dataclasses.replace(
                trial, model=dataclasses.replace(run.model, vocab_size=run.model.vocab_for_tp(layout.tp))
            )
        try:
            from mindspeed_like.plan.megatron_args import check

            check(trial.model, layout)
        except ConfigError:
            continue
        paths = megatron_paths() if level == 0 else levels[level].paths(trial)
        arm = predict_arm(trial, "megatron" if level == 0 else "features", paths)
        peaks = tuple(s.peak.total for s in arm.stages)
        time = timing.step_time(trial, cal, level=level)
        candidates.append(Candidate(level, rc, layout, peaks, time.seconds, time.factors))
    if not candidates:
        raise ConfigError("plan --fit: no layout of these sizes divides the model (heads, layers, sequence, batch)")
    usable = budget * (1 - headroom)
    fitting = [c for c in candidates if c.peak <= usable]
    best = None
    if fitting:
        # within 1% of the fastest, the smaller model-parallel group, then the larger micro-batch
        fastest = min(c.seconds for c in fitting)
        best = min(
            fitting,
            key=lambda c: (
                round(c.seconds / fastest, 2),
                c.layout.tp * c.layout.pp * c.layout.cp,
                -c.layout.micro_batch_size,
                c.peak,
            ),
        )
    leanest = min(candidates, key=lambda c: c.peak)
    chosen = best or leanest
    return FitResult(
        run=run,
        budget=budget,
        best=best,
        leanest=leanest,
        tried=len(candidates),
        usable=int(usable),
        reasons=tuple(_reasons(chosen, candidates, int(usable))),
        command=command_line(run, chosen),
        calibration=cal,
    )


def _preset(run: Run) -> str | None:
    if run.source != "compare":
        return None
    command = list(run.command)
    return command[command.index("--preset") + 1] if "--preset" in command else None


def _reasons(chosen: Candidate, candidates: list[Candidate], budget: int) -> list[str]:
    """The alternatives one choice away from ``chosen``: why not them."""
    out = []
    by_key = {c.key(): c for c in candidates}
    base = chosen.key()
    names = ("--optimization-level", "--recompute-granularity", "--micro-batch-size", "TP", "PP", "CP", "EP")
    for index, name in enumerate(names):
        values = sorted({c.key()[index] for c in candidates}, key=lambda v: (v is None, v))
        if len(values) < 2:
            continue
        parts = []
        for value in values:
            if value == base[index]:
                continue
            other = by_key.get(base[:index] + (value,) + base[index + 1 :])
            if other is None:
                continue
            label = "none" if value is None else value
            if other.peak > budget:
                parts.append(f"{label}: {size(other.peak)}, {size(other.peak - budget)} over")
            else:
                slower = 100 * (other.seconds / chosen.seconds - 1)
                parts.append(f"{label}: fits ({size(other.peak)}) but {slower:+.0f}% step time")
        if parts:
            out.append(f"{_choice(name, base[index])} (peak {size(chosen.peak)}); instead " + "; ".join(parts))
    return out


def _choice(name: str, value: object) -> str:
    """One choice as the command line says it (no recomputation is the option left out)."""
    return f"no {name}" if value is None else f"{name} {value}"


def command_line(run: Run, c: Candidate) -> str:
    """A ready command line: compare's for compare's options, else Megatron-LM's (the given
    arguments with the chosen values replacing theirs)."""
    flag = f"--optimization-level {c.level}"
    if run.source == "compare":
        tokens = _drop(list(run.command), {"--optimization-level": 1})
        return "mindspeed-like compare " + shlex.join([*tokens, *flag.split()])
    lay = c.layout
    replace = {
        "--tensor-model-parallel-size": str(lay.tp),
        "--pipeline-model-parallel-size": str(lay.pp),
        "--context-parallel-size": str(lay.cp),
        "--micro-batch-size": str(lay.micro_batch_size),
    }
    if run.model.is_moe:
        replace["--expert-model-parallel-size"] = str(lay.ep)
    tokens = _drop(
        list(run.command),
        {
            **{k: 1 for k in replace},
            "--optimization-level": 1,
            "--recompute-granularity": 1,
            "--recompute-method": 1,
            "--recompute-num-layers": 1,
            "--recompute-activations": 0,
            "--sequence-parallel": 0,
            "--use-distributed-optimizer": 0,
        },
    )
    for option, value in replace.items():
        tokens += [option, value]
    if lay.sequence_parallel:
        tokens.append("--sequence-parallel")
    if lay.distributed_optimizer and lay.fsdp is None:
        tokens.append("--use-distributed-optimizer")
    rc = c.recompute
    if rc.granularity == "full":
        tokens += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            rc.method or "uniform",
            "--recompute-num-layers",
            str(rc.num_layers or 1),
        ]
    elif rc.granularity == "selective":
        tokens += ["--recompute-granularity", "selective"]
    tokens += flag.split()
    # quoted for a shell: Megatron-LM's list options, e.g. --moe-layer-freq '([0]+[1]*26)'
    return "pretrain_gpt.py (with `import mindspeed_like.megatron_adaptor`) " + shlex.join(tokens)


def _drop(tokens: list[str], options: dict[str, int]) -> list[str]:
    """``tokens`` without the given options (and their ``n`` values)."""
    out, skip = [], 0
    for token in tokens:
        if skip:
            skip -= 1
            continue
        name = token.split("=", 1)[0]
        if name in options:
            skip = options[name] if "=" not in token else 0
            continue
        out.append(token)
    return out


def render_fit(result: FitResult) -> str:
    budget, usable = size(result.budget), size(result.usable)
    given = as_given(result.budget)
    lines = [f"--fit: {result.tried} configurations tried against {budget} a device{given} (usable: {usable})"]
    chosen = result.best
    if chosen is None:
        lean = result.leanest
        lines.append(
            f"nothing fits: the leanest configuration needs {size(lean.peak)} on its largest rank, "
            f"{size(lean.peak - result.usable)} more than the device's usable {size(result.usable)} ({result.command})"
        )
        # compare's options fix the layout (the fit searches levels only); a Megatron-LM command line's
        # layouts are searched within --world-size
        more = (
            "more ranks (compare's --tensor-model-parallel-size / --pipeline-model-parallel-size)"
            if result.run.source == "compare"
            else "more ranks (--world-size)"
        )
        lines.append(f"short by that much: {more}, a shorter sequence or a smaller micro-batch would be needed")
        lines += ["  " + r for r in result.reasons]
        return "\n".join(lines)
    lines.append("recommended: " + result.command)
    if result.run.device != "cpu":
        lines.append(
            "  (the peak is the allocator's: the CUDA context, communication buffers and fragmentation come on top; "
            "give --device-memory with headroom)"
        )
    lines.append(
        "  predicted peak per pipeline stage: "
        + ", ".join(size(p) for p in chosen.peaks)
        + f"; predicted step time {chosen.seconds:.3g} s ({result.calibration.flops_source})"
    )
    for name, value in chosen.factors.items():
        lines.append(f"  x {value:.3f}  {name}")
    lines.append("why:")
    lines += ["  " + r for r in result.reasons]
    return "\n".join(lines)


def fit_json(result: FitResult) -> dict[str, Any]:
    chosen = result.best or result.leanest
    return {
        "fits": result.best is not None,
        "command": result.command,
        "level": chosen.level,
        "peak_per_stage_bytes": list(chosen.peaks),
        "predicted_step_time_s": chosen.seconds,
        "short_by_bytes": 0 if result.best else chosen.peak - result.usable,
        "usable_bytes": result.usable,
        "why": list(result.reasons),
        "tried": result.tried,
    }
