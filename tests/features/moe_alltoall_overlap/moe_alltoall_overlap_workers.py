"""Functions run in spawned gloo processes by test_moe_alltoall_overlap_distributed.py."""

from __future__ import annotations

STEPS = 3


def train(seed: int, cases: dict) -> dict:
    """Each case (EP=2 tiny MoE GPT, alltoall dispatcher) trained with the feature off and on
    (the case's extra flags only in the "on" run): losses, the last step's gradients, the final
    weights, how many MoE layer calls the pipeline ran, and the bytes step 0's forward saved for
    backward."""
    import mindspeed_like
    from mindspeed_like.features.moe_alltoall_overlap import pipeline
    from mindspeed_like.testing import SavedBytesMeter, destroy_parallel, init_parallel, tiny_gpt, train_steps

    runs: list = []
    original = pipeline.run_forward

    def counting(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    pipeline.run_forward = counting
    out: dict = {}
    try:
        for name, (flags, model_kwargs) in cases.items():
            for on in (False, True):
                mindspeed_like.reset()
                mindspeed_like.configure(device="cpu", moe_alltoall_overlap_comm=on, **(flags if on else {}))
                init_parallel(ep=2, seed=seed)
                kept: dict = {}
                meters = [SavedBytesMeter()]
                runs.clear()
                losses = train_steps(
                    tiny_gpt(**model_kwargs),
                    STEPS,
                    seed=seed,
                    on_optimizer=lambda model, opt, kept=kept: kept.update(model=model),
                    forward_context=lambda step, m=meters: m[0] if step == 0 else SavedBytesMeter(),
                )
                params = dict(kept["model"].named_parameters())
                out[(name, on)] = dict(
                    losses=losses,
                    grads={k: p.main_grad.detach().numpy().copy() for k, p in params.items()},
                    weights={k: p.detach().numpy().copy() for k, p in params.items()},
                    pipelined=len(runs),
                    saved_bytes=meters[0].bytes,
                )
                destroy_parallel()
    finally:
        pipeline.run_forward = original
        mindspeed_like.reset()
    return out
