"""fix-fsdp2-resume under ``--bf16``: Adam's step is restored into states that hold no ``step``.

Megatron-LM's ``--use-torch-fsdp2 --ckpt-format torch_dist --bf16`` resume loads in place, then the
fix puts the saved ``common_step`` into each parameter's state. Under ``--bf16`` the optimizer is
megatron's Float16 optimizer, whose load-time ``init_state_fn`` writes the moments only (FusedAdam's
layout, no ``step``); the fix set the step only where one existed, so it set none, torch's Adam
restarted its bias correction at step 1, and the second iteration after the load drifted
(pretrain_gpt.py, 2 gloo ranks, dropout 0.1, saved at 3: lm loss 5.252592 vs 5.279777 at iteration
5). Megatron's own ``_restore_common_per_param_step`` sets it on every state.
"""

from __future__ import annotations

import types

import torch

from mindspeed_like.fixes.fsdp2_resume import restore_steps


def _adam_with_moments_only(n: int = 3) -> torch.optim.Adam:
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]
    adam = torch.optim.Adam(params, lr=1e-3)
    for p in params:  # megatron's init_state_fn for Adam: moments, no step
        adam.state[p]["exp_avg"] = torch.zeros_like(p)
        adam.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    return adam


def test_a_float16_optimizers_moment_only_states_get_the_saved_step():
    adam = _adam_with_moments_only()
    float16 = types.SimpleNamespace(optimizer=adam)  # Float16OptimizerWithFloat16Params holds torch's as .optimizer
    saved = {
        "optimizer": {"state": {"common_step": torch.tensor(3.0)}, "param_groups": []},
        "fp32_from_fp16_params": [],
    }
    assert restore_steps(float16, saved) == 3
    assert [float(s["step"]) for s in adam.state.values()] == [3.0, 3.0, 3.0]


def test_the_next_step_continues_the_bias_correction():
    """Adam after the restore steps as an Adam that took 3 steps: step 4's update, not step 1's."""
    torch.manual_seed(0)
    reference = _adam_with_moments_only(1)
    (p_ref,) = reference.param_groups[0]["params"]
    restored = torch.optim.Adam([torch.nn.Parameter(p_ref.detach().clone())], lr=1e-3)
    (p_new,) = restored.param_groups[0]["params"]
    for p, opt in ((p_ref, reference), (p_new, restored)):
        opt.state[p]["exp_avg"] = torch.full_like(p, 0.1)
        opt.state[p]["exp_avg_sq"] = torch.full_like(p, 0.01)
    reference.state[p_ref]["step"] = torch.tensor(3.0)
    restore_steps(
        types.SimpleNamespace(optimizer=restored), {"optimizer": {"state": {"common_step": torch.tensor(3.0)}}}
    )
    grad = torch.randn(4)
    for p, opt in ((p_ref, reference), (p_new, restored)):
        p.grad = grad.clone()
        opt.step()
    assert torch.equal(p_new, p_ref)


def test_a_parameter_never_stepped_keeps_an_empty_state():
    adam = _adam_with_moments_only(2)
    extra = torch.nn.Parameter(torch.randn(4))
    adam.add_param_group({"params": [extra]})
    restore_steps(types.SimpleNamespace(optimizer=adam), {"state": {"common_step": torch.tensor(2.0)}})
    assert extra not in adam.state or not adam.state[extra]
