"""One prepared check of the optimizer step on a GPU: megatron's own step vs reuse-fp32-param's
(and the precision-aware optimizer's), timed and compared bit for bit.

    python3 -m mindspeed_like.testing.optimizer_step_check [--device cuda] [--quick] [--json PATH]

Prints one line per finding (well under 60 s on one H100 at the default ~320M parameters):

- the tie kernels: whether the Triton kernels passed their once-per-device check against the eager
  ops on crafted bit patterns (``kernels/bf16_ties.py``), and their speed on one 2**24 piece;
- megatron's ``Float16OptimizerWithFloat16Params`` step and reuse-fp32-param's on the same model,
  weights and gradients: the median of ``--repeats`` steps (CUDA events around ``optimizer.step()``,
  after warm-up), the ratio against the target (<= 1.1x), the peak transient memory of a step;
- after ``--steps`` steps: bf16 weights, fp32 masters (as megatron's ``state_dict`` writes them:
  the checkpoint path) and Adam's moments bitwise equal (yes/NO each), with the number of ties;
- one more step of reuse-fp32-param's inner step under ``torch.cuda.set_sync_debug_mode("error")``:
  any host sync there raises and is printed;
- megatron's DistributedOptimizer (DP=1) vs the precision-aware optimizer (fp32 moments: bf16
  weights bitwise; bf16 moments with remainders: time only), unless ``--no-precision-aware``.

The model is a llama-shaped megatron GPT (6 layers, hidden 2048, SwiGLU ffn 4096, vocab 16384:
~320M bf16 parameters); gradients are seeded on the device and written into megatron's DDP grad
buffer; Adam lr 1e-4, weight decay 0.01, clip-grad 1.0 (as Megatron-LM's defaults).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch

SIZE = dict(num_layers=6, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=4096, vocab_size=16384)
QUICK = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)


def _say(line: str, out: dict) -> None:
    out.setdefault("lines", []).append(line)
    print(line, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Milliseconds of ``fn()`` on the device (CUDA events; the host clock on a CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end)


def check_tie_kernels(device: torch.device, out: dict) -> None:
    from mindspeed_like.kernels import bf16_ties

    if device.type != "cuda":
        _say(f"tie kernels: not checked on {device.type} (the Triton kernels serve CUDA tensors)", out)
        return
    used = bf16_ties._fused(torch.zeros(8, dtype=torch.int16, device=device))
    patterns = bf16_ties.crafted(device).numel()
    if not used:
        _say("tie kernels: NOT used here; the eager bit ops run (a warning above says why if they failed)", out)
        return
    n = 1 << 24
    master = torch.randn(n, device=device)
    buf = torch.empty(2 * n, dtype=torch.int16, device=device)
    ties = bf16_ties.BitTies(n, device)
    for _ in range(3):
        ties.encode(master, buf[:n], buf[n:], 0)
        ties.decode(buf[:n], buf[n:], 0, master)
    encode = statistics.median(_timed(device, lambda: ties.encode(master, buf[:n], buf[n:], 0)) for _ in range(10))
    decode = statistics.median(_timed(device, lambda: ties.decode(buf[:n], buf[n:], 0, master)) for _ in range(10))
    gbs = n * (8 + 1 / 8) / 1e6  # bytes moved per call / 1e6 -> GB/s with ms
    _say(
        f"tie kernels: Triton, bitwise the eager ops on {patterns:,} crafted patterns; 2^24 elements: "
        f"encode {encode * 1e3:.0f} us ({gbs / encode:.0f} GB/s), "
        f"decode {decode * 1e3:.0f} us ({gbs / decode:.0f} GB/s)",
        out,
    )


def _build(device: torch.device, size: dict, flags: dict, distributed: bool, fields: dict):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import mindspeed_like
    from mindspeed_like.workloads import init_parallel, tiny_gpt

    mindspeed_like.reset()
    mindspeed_like.configure(device=device.type, **flags)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    init_parallel(seed=1234)
    model = tiny_gpt(bf16=True, use_cpu_initialization=device.type == "cpu", seq_length=64, **size).to(device)
    grads_fp32 = fields.get("main_grads_dtype", torch.float32) == torch.float32
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grads_fp32, use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    config = OptimizerConfig(
        optimizer="adam",
        bf16=True,
        use_distributed_optimizer=distributed,
        lr=1e-4,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        **fields,
    )
    opt = get_megatron_optimizer(config, [ddp])
    torch.manual_seed(7)  # the same gradients in every case (the device's generator, seeded)
    for param in ddp.parameters():
        param.main_grad.copy_(torch.randn(param.shape, device=device).mul_(1e-2))
    return ddp, opt


def _inner(opt) -> list:
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def _snapshot(ddp, opt) -> dict[str, list[torch.Tensor]]:
    """What the steps left, as bit patterns (on the device)."""
    state = {"bf16 weights": [p.detach().view(torch.int16).clone() for p in ddp.parameters()]}
    masters, exp_avg, exp_avg_sq = [], [], []
    for inner in _inner(opt):
        if hasattr(inner, "fp32_from_float16_groups"):
            saved = inner.state_dict()["fp32_from_fp16_params"]  # the checkpoint path
            masters += [p.detach().view(torch.int32).clone() for g in saved for p in g]
        torch_opt = getattr(inner, "optimizer", None)
        if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):  # not the precision-aware Adam
            for group in torch_opt.param_groups:
                for p in group["params"]:
                    exp_avg.append(torch_opt.state[p]["exp_avg"].detach().clone())
                    exp_avg_sq.append(torch_opt.state[p]["exp_avg_sq"].detach().clone())
    if masters:
        state["fp32 masters"] = masters
    if exp_avg:
        state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
    return state


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def run_case(device: torch.device, size: dict, args, flags: dict, distributed: bool = False, fields=None) -> dict:
    """Build, ``args.steps`` steps (snapshot), then warm-up and ``args.repeats`` timed steps."""
    fields = fields or {}
    ddp, opt = _build(device, size, flags, distributed, fields)
    for _ in range(args.steps):
        opt.step()
    _sync(device)
    result = {"state": _snapshot(ddp, opt), "numel": sum(p.numel() for p in ddp.parameters())}
    for _ in range(2):
        opt.step()
    times, peaks = [], []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        times.append(_timed(device, opt.step))
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
    result["ms"] = statistics.median(times)
    result["peak_gib"] = max(peaks) / 2**30 if peaks else float("nan")
    if flags.get("reuse_fp32_param"):
        result.update(_reuse_details(device, opt))
        if device.type == "cuda":
            result["sweep"] = _chunk_sweep(device, opt)
    del ddp, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _reuse_details(device: torch.device, opt) -> dict:
    """Ties held, which tie record, and one more step with host syncs made errors."""
    from mindspeed_like.features.reuse_fp32_param import chunked_step, state_of

    states = [state_of(inner) for inner in _inner(opt)]
    states = [s for s in states if s is not None]
    details = {
        "ties": sum(e.side.count() for s in states for e in s.entries),
        "record": sorted({type(e.side).__name__ for s in states for e in s.entries}),
        "batch": sorted({s.batch for s in states}),
        "sync": "not checked (not CUDA)",
    }
    if device.type == "cuda":
        real = chunked_step.step

        def strict(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        chunked_step.step = strict
        try:
            opt.step()
            details["sync"] = "none"
        except RuntimeError as error:
            details["sync"] = f"FOUND: {str(error).splitlines()[0]}"
        finally:
            chunked_step.step = real
    return details


def _chunk_sweep(device: torch.device, opt) -> dict[int, tuple[float, float]]:
    """reuse-fp32-param's step at other batch sizes (its workspace): ms (median of 5), peak GiB."""
    from mindspeed_like.features.reuse_fp32_param import state_of

    states = [s for s in (state_of(inner) for inner in _inner(opt)) if s is not None]
    default = states[0].batch
    sweep = {}
    for chunk in (1 << 23, 1 << 24, 1 << 25, 1 << 26):
        for state in states:
            state.batch = chunk
        opt.step()
        times, peak = [], 0
        for _ in range(5):
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            times.append(_timed(device, opt.step))
            peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        sweep[chunk] = (statistics.median(times), peak / 2**30)
    for state in states:
        state.batch = default
    return sweep


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke test of this script)")
    parser.add_argument("--steps", type=int, default=3, help="steps before the bitwise comparison")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--no-precision-aware", action="store_true", help="skip the precision-aware cases")
    parser.add_argument("--json", help="write the findings here")
    parser.add_argument(
        "--backend", help="force a kernel backend (e.g. 'cuda' on a CPU: this script's CUDA path without a GPU)"
    )
    args = parser.parse_args(argv)
    if args.backend:
        from mindspeed_like.kernels.backend import force_backend

        with force_backend(args.backend):
            return _main(args)
    return _main(args)


def _main(args) -> dict:
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index ("cuda" alone raised on the H100 run)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    size = QUICK if args.quick else SIZE
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    from mindspeed_like.megatron_version import megatron_core_version

    _say(
        f"device: {out['device']}, torch {torch.__version__}, triton {triton_version}, "
        f"megatron-core {megatron_core_version()}",
        out,
    )
    check_tie_kernels(device, out)
    base = run_case(device, size, args, {})
    ours = run_case(device, size, args, {"reuse_fp32_param": True})
    _say(f"model: {base['numel'] / 1e6:.1f}M bf16 params {size}", out)
    ratio = ours["ms"] / base["ms"]
    out["float16"] = {"megatron_ms": base["ms"], "reuse_ms": ours["ms"], "ratio": ratio}
    _say(
        f"Float16 step, megatron: {base['ms']:.2f} ms (median of {args.repeats}), "
        + f"peak transient {base['peak_gib']:.2f} GiB",
        out,
    )
    verdict = "met" if ratio <= 1.1 else "MISSED"
    _say(
        f"Float16 step, reuse-fp32-param: {ours['ms']:.2f} ms, peak transient {ours['peak_gib']:.2f} GiB; "
        f"ratio {ratio:.3f} (target <= 1.10: {verdict}); tie record {ours['record']}, batch {ours['batch']}",
        out,
    )
    same = {k: _same(base["state"][k], ours["state"].get(k, [])) for k in base["state"]}
    out["bitwise"] = same
    _say(
        f"bitwise after {args.steps} steps: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items())
        + f" (ties held now: {ours['ties']:,})",
        out,
    )
    _say(f"host syncs in reuse-fp32-param's inner step (sync debug mode 'error'): {ours['sync']}", out)
    if "sweep" in ours:
        out["sweep"] = ours["sweep"]
        _say(
            "reuse-fp32-param step by batch size: "
            + ", ".join(
                f"2^{c.bit_length() - 1}: {ms:.2f} ms / {gib:.2f} GiB" for c, (ms, gib) in ours["sweep"].items()
            )
            + f" (megatron {base['ms']:.2f} ms / {base['peak_gib']:.2f} GiB)",
            out,
        )
    if not args.no_precision_aware:
        dist_base = run_case(device, size, args, {}, distributed=True)
        fp32 = dict(
            use_precision_aware_optimizer=True,
            exp_avg_dtype=torch.float32,
            exp_avg_sq_dtype=torch.float32,
            main_grads_dtype=torch.float32,
        )
        pa = run_case(device, size, args, {}, distributed=True, fields=fp32)
        low = dict(fp32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)
        low["main_grads_dtype"] = torch.bfloat16
        pa_low = run_case(device, size, args, {}, distributed=True, fields=low)
        weights = _same(dist_base["state"]["bf16 weights"], pa["state"]["bf16 weights"])
        out["precision_aware"] = {
            "megatron_ms": dist_base["ms"],
            "fp32_ms": pa["ms"],
            "bf16_ms": pa_low["ms"],
            "fp32_weights_bitwise": weights,
        }
        _say(f"DistributedOptimizer step (DP=1), megatron: {dist_base['ms']:.2f} ms", out)
        _say(
            f"precision-aware, fp32 moments: {pa['ms']:.2f} ms ({pa['ms'] / dist_base['ms']:.2f}x), "
            f"bf16 weights bitwise megatron's after {args.steps} steps: {'yes' if weights else 'NO'}",
            out,
        )
        _say(
            f"precision-aware, bf16 moments + bf16 grads + remainders: {pa_low['ms']:.2f} ms "
            f"({pa_low['ms'] / dist_base['ms']:.2f}x; other numbers by design)",
            out,
        )
    out["wall_s"] = time.perf_counter() - started
    _say(f"wall: {out['wall_s']:.0f} s", out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
