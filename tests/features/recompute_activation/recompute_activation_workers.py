"""Functions run in spawned gloo processes by test_recompute_activation_distributed.py."""

from __future__ import annotations

STEPS = 4


def suite(seed: int = 1234) -> dict:
    """One 2-process run: TP=2+SP dense and MoE, EP=2 MoE, each trained with and without the
    feature; and the layer numbers recorded per pipeline stage at PP=2."""
    import mindspeed_like
    from mindspeed_like.features.recompute_activation import mlp as ra
    from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt, train_steps

    made: list = []
    original = ra.Recompute.checkpoint

    def counting(self):
        made.append(1)
        return original(self)

    ra.Recompute.checkpoint = counting
    cases = {
        "tp2_sp": (dict(tp=2), dict(sequence_parallel=True, hidden_dropout=0.1, attention_dropout=0.1)),
        "tp2_sp_moe": (dict(tp=2), dict(sequence_parallel=True, num_moe_experts=4)),
        "ep2_moe": (dict(ep=2), dict(num_moe_experts=4, hidden_dropout=0.1)),
    }
    out: dict = {}
    for name, (parallel, model_kwargs) in cases.items():
        for on in (False, True):
            mindspeed_like.reset()
            mindspeed_like.configure(device="cpu", recompute_activation_function=on)
            init_parallel(seed=seed, **parallel)
            made.clear()
            out[(name, on)] = train_steps(tiny_gpt(**model_kwargs), STEPS, seed=seed)
            out[(name, on, "checkpoints")] = len(made)
            destroy_parallel()

    out["pp2"] = _pipeline_stage(seed, made)
    ra.Recompute.checkpoint = original
    mindspeed_like.reset()
    return out


def _pipeline_stage(seed: int, made: list) -> dict:
    """PP=2, 4 layers, ``num_layers=1``: each stage recomputes only its own first layer."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    import mindspeed_like
    from mindspeed_like.features.recompute_activation import mlp as ra
    from mindspeed_like.testing import destroy_parallel, gpt_config, init_parallel

    mindspeed_like.reset()
    mindspeed_like.configure(
        device="cpu", recompute_activation_function=True, recompute_activation_function_num_layers=1
    )
    init_parallel(pp=2, seed=seed)
    block = TransformerBlock(gpt_config(num_layers=4, pipeline_dtype=torch.float32), get_gpt_layer_local_spec())
    hidden = torch.randn(16, 2, 64, requires_grad=True)
    made.clear()
    block(hidden, attention_mask=None).sum().backward()
    result = dict(
        global_numbers=[layer.layer_number for layer in block.layers],
        stage_numbers=[getattr(layer.mlp, ra.STAGE_LAYER_ATTR) for layer in block.layers],
        checkpoints=len(made),
    )
    destroy_parallel()
    return result
