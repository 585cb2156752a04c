"""What Megatron-LM's own GPT saves for backward in one forward, on the CPU: the model
``pretrain_gpt.py`` builds from a command line (``gpt_builders.gpt_builder``, the local spec), fed
the batch its dataloader makes (the b x 1 x s x s bool mask unless
``--no-create-attention-mask-in-dataloader``), metered with :class:`SavedBytesMeter` (parameters
left out). The plan's checks hold ``mindspeed-like plan``'s megatron column to it (opt-in: needs
``MEGATRON_LM_PATH``).

    python -m mindspeed_like.testing.megatron_lm_saved <pretrain_gpt.py model options>   # prints JSON

One process, world 1 (gloo); megatron's CUDA RNG calls are answered by the CPU generator, and the
fused kernels that need CUDA or Apex are switched off as a CPU user must (their saves are the
unfused ones': rope, masked softmax, bias-GELU and bias-dropout fusion are not modeled apart).
"""

from __future__ import annotations

import json
import os
import sys

CPU_SWITCHES = [
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--use-cpu-initialization",
]


def main(argv: list[str]) -> dict[str, int]:
    megatron_lm = os.environ["MEGATRON_LM_PATH"]
    sys.path.insert(0, megatron_lm)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch
    import torch.distributed as dist

    from mindspeed_like.workloads.parallel import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    # megatron's CUDA RNG bookkeeping, answered by the CPU generator (no CUDA on this host)
    torch.cuda.current_device = lambda: "cpu"  # the RNG tracker's device, the model's init device
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    import megatron.core.tensor_parallel.random as rng

    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    dist.init_process_group("gloo", rank=0, world_size=1)
    padded = None
    if "--padded-vocab-size" in argv:
        i = argv.index("--padded-vocab-size")
        padded = int(argv[i + 1])
        del argv[i : i + 2]
    sys.argv = ["pretrain_gpt.py", *argv, *CPU_SWITCHES]
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = padded
    global_vars.set_args(args)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    import gpt_builders

    from mindspeed_like.workloads.memory import SavedBytesMeter

    model = gpt_builders.gpt_builder(args, True, True)
    if args.bf16:
        model = model.to(torch.bfloat16)
    elif args.fp16:
        model = model.half()
    model.train()
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, 255, (b, s))
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = None
    if args.create_attention_mask_in_dataloader:  # GPTDataset's per-sample [1, s, s], collated
        mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().expand(b, 1, s, s).contiguous()
    with SavedBytesMeter() as meter:
        loss = model(tokens, position_ids, mask, labels=torch.randint(0, 255, (b, s)))
    saved = meter.current_bytes(exclude=list(model.parameters()))
    loss.float().mean().backward()
    return {"saved_bytes": int(saved), "parameters": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
