"""Activation-function recompute: megatron's MLP block (fc1 -> swiglu -> fc2) fwd+bwd with and
without ``--recompute-activation-function``, in the same process on the same module.

Per case: bytes the block holds for backward after its forward (saved-tensor hooks, storage
sizes read after the forward, parameters excluded), the peak of live tensor bytes during
fwd+bwd (every storage an op creates, summed after each op: exact bytes, not RSS; the
parameters and the input are not counted), and the median fwd+bwd time (runs interleaved
off/on so machine noise hits both alike). Then the demo GPT's (``mindspeed-like demo``
sizes) whole-model peak for one micro-batch fwd+bwd. ``--device cuda``: the same on the GPU (the
counts are of that device's storages; times with the device synchronised around each pass).

Targets (checked, printed as met/missed): held bytes drop by at least tokens x ffn x dtype
size per layer (the activation output); time overhead under 5% of the block's fwd+bwd.

    python benchmarks/recompute_activation.py [--quick] [--repeats N] [--hidden H --ffn F --seq S] [--json out.json]
"""

from __future__ import annotations

import statistics
import time
import weakref

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mindspeed_like
from mindspeed_like.testing import SavedBytesMeter, init_parallel, tiny_gpt

MiB = 2**20
TIME_TARGET = 0.05


class PeakLiveBytes(TorchDispatchMode):
    """Peak of the bytes of live storages created by ops inside the block (sampled after
    every op; storages resized to 0 count 0, so a freed activation output stops counting)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                storage = tensor.untyped_storage()
                self.live.setdefault(storage._cdata, storage)
        self.peak = max(self.peak, sum(s.nbytes() for s in list(self.live.values())))
        return out


def _set_flag(on: bool) -> None:
    mindspeed_like.configure(recompute_activation_function=on)


def _mlp_block(hidden: int, ffn: int, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from mindspeed_like.testing import gpt_config

    config = gpt_config(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=8, **overrides)
    spec = get_gpt_layer_local_spec().submodules.mlp
    return build_module(spec, config=config, ffn_hidden_size=ffn)


def _measure(fn_forward, params) -> tuple[int, int]:
    """(bytes held for backward after the forward, peak live bytes of fwd+bwd)."""
    mode = PeakLiveBytes()
    with mode:
        with SavedBytesMeter() as meter:
            loss = fn_forward()
        held = meter.current_bytes(exclude=params)
        loss.backward()
    return held, mode.peak


def _interleaved_times(step_off, step_on, repeats: int) -> tuple[float, float]:
    off, on = [], []
    for _ in range(repeats):
        for on_flag, step, times in ((False, step_off, off), (True, step_on, on)):
            _set_flag(on_flag)
            common.sync()
            start = time.perf_counter()
            step()
            common.sync()
            times.append(time.perf_counter() - start)
    common.add_samples("megatron", off)  # kept in the record under the next row
    common.add_samples("recompute", on)
    return statistics.median(off), statistics.median(on)


def _measure_off_on(
    args, results: common.Results, case: str, forward, step, params, *, output_bytes: int, time_target: bool
) -> None:
    """Held/peak bytes and interleaved fwd+bwd times with the flag off and on; one result row.
    ``output_bytes``: the activation outputs the flag should free (the saved-bytes target)."""
    figures = {}
    for on in (False, True):
        _set_flag(on)
        step()  # warm-up
        figures[on] = _measure(forward, params)
    t_off, t_on = _interleaved_times(step, step, args.repeats)
    drop = figures[False][0] - figures[True][0]
    if time_target:
        timing = "met" if t_on / t_off - 1 < TIME_TARGET else "missed"
    else:
        timing = "(not a target)"
    results.add(
        case=case,
        held_off_MiB=figures[False][0] / MiB,
        held_on_MiB=figures[True][0] / MiB,
        held_drop_MiB=drop / MiB,
        drop_per_output=drop / output_bytes,
        peak_off_MiB=figures[False][1] / MiB,
        peak_on_MiB=figures[True][1] / MiB,
        off_ms=t_off * 1e3,
        on_ms=t_on * 1e3,
        time_ratio=t_on / t_off,
        saved_target="met" if drop >= output_bytes else "missed",
        time_target=timing,
    )


def bench_mlp(args, results: common.Results, label: str, hidden: int, ffn: int, seq: int, **overrides) -> None:
    torch.manual_seed(0)
    device = common.device()
    mlp = _mlp_block(hidden, ffn, **overrides).to(device)
    params = list(mlp.parameters())
    x = torch.randn(seq, 1, hidden, device=device, requires_grad=True)
    grad = torch.randn(seq, 1, hidden, device=device)

    def forward():
        out, _ = mlp(x)
        return (out * grad).sum()

    def step():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        forward().backward()

    _measure_off_on(
        args,
        results,
        f"MLP {label} h{hidden} ffn{ffn} seq{seq}",
        forward,
        step,
        params + [x],
        output_bytes=seq * ffn * x.element_size(),
        time_target=True,
    )


def bench_demo_gpt(args, results: common.Results) -> None:
    """The demo's model (4 layers, hidden 256, 8 heads, seq 128, micro-batch 8, fp32)."""
    layers, hidden, seq, batch = 4, 256, 128, 8
    torch.manual_seed(0)
    init_parallel(seed=1234)
    device = common.device()
    model = tiny_gpt(num_layers=layers, hidden_size=hidden, num_attention_heads=8, seq_length=seq, vocab_size=256)
    model = model.to(device)
    params = list(model.parameters())
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)

    def forward():
        return model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()

    def step():
        model.zero_grad(set_to_none=True)
        forward().backward()

    _measure_off_on(
        args,
        results,
        f"demo GPT {layers}L h{hidden} seq{seq} mbs{batch}",
        forward,
        step,
        params,
        output_bytes=layers * batch * seq * model.config.ffn_hidden_size * 4,
        time_target=False,
    )


def run(args, results: common.Results) -> None:
    common.configure()
    common.init_process_group()
    init_parallel(seed=1234)
    hidden, ffn, seq = (1024, 2752, 512) if args.quick else (4096, 11008, 2048)
    hidden, ffn, seq = args.hidden or hidden, args.ffn or ffn, args.seq or seq
    bench_mlp(args, results, "swiglu", hidden, ffn, seq)
    bench_mlp(args, results, "swiglu fused", hidden, ffn, seq, bias_activation_fusion=True)
    bench_demo_gpt(args, results)
    mindspeed_like.configure(recompute_activation_function=False)


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, help="MLP hidden size (default 4096; --quick 1024)")
    parser.add_argument("--ffn", type=int, help="MLP ffn size (default 11008; --quick 2752)")
    parser.add_argument("--seq", type=int, help="tokens (sequence length, batch 1; default 2048; --quick 512)")
    args = parser.parse_args()
    results = common.Results("recompute_activation")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
