"""Output layer + loss fwd+bwd: megatron-core's path (its ColumnParallelLinear output layer, then
``vocab_parallel_cross_entropy`` on the logits, as ``GPTModel`` does) vs ours
(``--use-fused-linear-cross-entropy``: the same layer's weight through the chunked kernel, via the
feature's own ``fused_output_loss``), in one run on the same weights and inputs, at TP=1 and TP=2
(2 processes, one thread each; per-rank figures of rank 0).

Block: hidden states ``[tokens, 1, hidden]`` -> per-token loss -> ``loss.mean().backward()``.
Time: median of ``--repeats`` passes. Memory: peak bytes created during one pass (torch.profiler
memory timeline, as benchmarks/common.py's ``peak_bytes``; the weights and inputs exist before
and are not counted). Targets (checked here): peak memory of the block >= 4x lower at vocab
128k; time <= 1.2x megatron's. Then the whole-model check: a GPT with a 128k vocabulary, one
training forward+backward, peak with and without the flag.

On a GPU (``--device cuda``): TP=1 (one process per device; a TP size larger than the device count
is skipped, saying so), and Liger-Kernel's Triton fused linear cross-entropy on the same hidden
states, weight and labels as the anchor (``liger_ms``, ``vs_liger`` = Liger's time / ours: >= 1 when
ours is at least as fast, ``liger_peak_MiB``; its column says why where it cannot run,
benchmarks/liger_anchor.py).

    python benchmarks/linear_cross_entropy.py [--quick] [--tokens N] [--hidden H] [--repeats N] [--device cuda]
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import common  # benchmarks/ is the script directory
import liger_anchor
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, gpt_config, init_parallel, run_distributed, tiny_gpt

MiB = 2**20
VOCABS = (32768, 131072, 151936)
TARGET_VOCAB, TARGET_MEMORY, TARGET_TIME = 131072, 4.0, 1.2


def _output_layer(vocab: int, hidden: int, dtype: torch.dtype):
    from megatron.core import tensor_parallel

    config = gpt_config(hidden_size=hidden, num_attention_heads=8, bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return tensor_parallel.ColumnParallelLinear(
        hidden,
        vocab,
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=False,
        skip_bias_add=False,
    )


def _megatron_step(layer, hidden, labels):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def step():
        layer.weight.grad = hidden.grad = None
        logits, _ = layer(hidden)
        vocab_parallel_cross_entropy(logits, labels).mean().backward()

    return step


def _our_step(layer, hidden, labels, chunk_tokens: int):
    from mindspeed_like.features.fused_linear_cross_entropy.postprocess import fused_output_loss

    model = SimpleNamespace(output_layer=layer, share_embeddings_and_output_weights=False)

    def step():
        layer.weight.grad = hidden.grad = None
        fused_output_loss(model, hidden, labels.t(), chunk_tokens).mean().backward()

    return step


def _liger_step(layer, hidden, labels):
    flat_hidden = hidden.detach().reshape(-1, hidden.shape[-1]).requires_grad_()
    flat_labels = labels.reshape(-1)

    def step():
        layer.weight.grad = flat_hidden.grad = None
        liger_anchor.fused_linear_cross_entropy(flat_hidden, layer.weight, flat_labels).backward()

    return step


def measure(tp: int, vocabs: tuple[int, ...], tokens: int, hidden_size: int, dtype_name: str, repeats: int) -> list:
    """One rank's figures per vocabulary (run in each process of a TP group)."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    device = common.device()
    mindspeed_like.reset()
    common.configure()
    if tp == 1:
        common.init_process_group()
    init_parallel(tp=tp, seed=0)
    liger_missing = liger_anchor.unavailable(device) if tp == 1 else "TP=1 only"
    rows = []
    try:
        for vocab in vocabs:
            layer = _output_layer(vocab, hidden_size, dtype).to(device)
            gen = torch.Generator().manual_seed(vocab)
            hidden = torch.randn(tokens, 1, hidden_size, generator=gen).to(device, dtype).requires_grad_()
            labels = torch.randint(0, vocab, (tokens, 1), generator=gen).to(device)
            figures = {}
            samples = {}
            steps = [("megatron", _megatron_step(layer, hidden, labels)), ("ours", _our_step(layer, hidden, labels, 0))]
            missing = liger_missing or common.anchor_fails(_liger_step(layer, hidden, labels))
            if missing is None:
                steps.append(("liger", _liger_step(layer, hidden, labels)))
            for name, step in steps:
                samples[name] = common.timed(step, repeats)
                figures[name] = (statistics.median(samples[name]), common.peak_bytes(step))
            (base_s, base_b), (ours_s, ours_b) = figures["megatron"], figures["ours"]
            liger_s, liger_b = figures.get("liger", (None, None))
            rows.append(
                dict(
                    tp=tp,
                    vocab=vocab,
                    hidden=hidden_size,
                    tokens=tokens,
                    dtype=dtype_name,
                    megatron_ms=base_s * 1e3,
                    ours_ms=ours_s * 1e3,
                    time_ratio=ours_s / base_s,
                    megatron_peak_MiB=base_b / MiB,
                    ours_peak_MiB=ours_b / MiB,
                    memory_ratio=base_b / max(ours_b, 1),
                    **common.anchor_columns("liger", None if liger_s is None else liger_s * 1e3, ours_s * 1e3, missing),
                    liger_peak_MiB="-" if liger_b is None else liger_b / MiB,
                    samples=samples,  # each repeat's seconds: the record's samples, not a printed column
                )
            )
            if dist.get_rank() == 0:
                print("measured:", rows[-1], flush=True)
            del layer, hidden
    finally:
        destroy_parallel()
        mindspeed_like.reset()
    return rows


def whole_model(vocab: int, seq: int, hidden: int) -> dict:
    """A GPT (2 layers, flash attention) with a large vocabulary: peak of one training forward+backward."""
    peaks = {}
    device = common.device()
    for on in (False, True):
        mindspeed_like.reset()
        # flash attention in both runs: megatron's own attention keeps s x s scores per head, which
        # at these lengths would hide what the output layer costs
        common.configure(use_flash_attn=True, use_fused_linear_cross_entropy=on)
        common.init_process_group()
        init_parallel(seed=0)
        model = tiny_gpt(
            wrap_float16=False, vocab_size=vocab, seq_length=seq, hidden_size=hidden, num_attention_heads=8
        ).to(device)
        ids = torch.randint(0, vocab, (1, seq), device=device)
        positions = torch.arange(seq, device=device).unsqueeze(0)

        def step(model=model, ids=ids, positions=positions):
            model.zero_grad(set_to_none=True)
            model(ids, positions, None, labels=ids).float().mean().backward()

        step()  # gradients exist before the measured pass, as in training
        peaks[on] = common.peak_bytes(step)
        destroy_parallel()
        del model
    mindspeed_like.reset()
    return dict(
        vocab=vocab,
        seq=seq,
        hidden=hidden,
        megatron_peak_MiB=peaks[False] / MiB,
        ours_peak_MiB=peaks[True] / MiB,
        memory_ratio=peaks[False] / max(peaks[True], 1),
    )


def check_targets(results: common.Results) -> list[str]:
    lines = []
    for row in results.rows:
        if row["vocab"] != TARGET_VOCAB:
            continue
        memory_ok = row["memory_ratio"] >= TARGET_MEMORY
        time_ok = row["time_ratio"] <= TARGET_TIME
        lines.append(
            f"TP={row['tp']} vocab {row['vocab']} {row['dtype']}: peak {row['memory_ratio']:.2f}x lower "
            f"(target >= {TARGET_MEMORY:g}x: {'met' if memory_ok else 'missed'}), time {row['time_ratio']:.2f}x "
            f"megatron's (target <= {TARGET_TIME:g}x: {'met' if time_ok else 'missed'})"
        )
    return lines or [f"targets are checked at vocab {TARGET_VOCAB} (not run)"]


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=common.positive_int, default=1024, help="tokens per pass (default 1024)")
    parser.add_argument("--hidden", type=common.positive_int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--tp", type=common.positive_int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)"
    )
    parser.add_argument(
        "--vocabs", type=common.positive_int, nargs="+", help=f"vocabulary sizes (default {' '.join(map(str, VOCABS))})"
    )
    parser.add_argument("--whole-model-only", action="store_true", help="only the whole-GPT peak")
    args = parser.parse_args()
    vocabs = tuple(args.vocabs or ((8192, TARGET_VOCAB) if args.quick else VOCABS))
    tokens = 256 if args.quick else args.tokens
    results = common.Results("linear_cross_entropy")
    devices = torch.cuda.device_count() if common.device().type == "cuda" else None
    for tp in [] if args.whole_model_only else args.tp:
        if common.on_accelerator() and tp > (devices or 1):
            print(f"TP={tp}: not run on {common.device().type} here (one process per device, {devices or 1} device(s))")
            continue
        if tp == 1:
            rows = measure(1, vocabs, tokens, args.hidden, args.dtype, args.repeats)
        else:
            rows = run_distributed(
                measure, tp, tp, vocabs, tokens, args.hidden, args.dtype, args.repeats, timeout=7200
            )[0]
        for row in rows:
            results.add(**row)
    if results.rows:
        results.print_table()
        for line in check_targets(results):
            print(line)
    model = whole_model(TARGET_VOCAB, 1024 if args.quick else 4096, 256 if args.quick else 512)
    print(
        f"whole GPT (2 layers, flash attention, hidden {model['hidden']}, vocab {model['vocab']}, seq {model['seq']}): "
        f"peak "
        f"{model['megatron_peak_MiB']:.1f} MiB -> {model['ours_peak_MiB']:.1f} MiB ({model['memory_ratio']:.2f}x lower)"
    )
    results.write_json(args.json, whole_model=model)


if __name__ == "__main__":
    main()
