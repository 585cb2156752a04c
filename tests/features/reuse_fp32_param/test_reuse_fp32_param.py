"""reuse-fp32-param on megatron-core's real GPTModel (tiny_gpt, bf16, CPU/gloo).

Every comparison is bitwise (per-step losses as Python floats, fp32 masters as int32 bit
patterns, bf16 weights as int16 bit patterns): the feature changes where bytes live, never a
value, so there is no tolerance to state.
"""

from __future__ import annotations

import pytest
import reuse_fp32_workers as W
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed, tiny_gpt, train_steps
from mindspeed_like.toolkit.errors import ConfigError

STEPS = 20


@pytest.fixture(autouse=True)
def _reset():
    yield
    destroy_parallel()
    mindspeed_like.reset()


@pytest.fixture(scope="module")
def baseline():
    return W.train(False, STEPS)


def test_float16_optimizer_bitwise_parity_and_4_bytes_per_param(baseline):
    ours = W.train(True, STEPS)
    assert W.same(baseline, ours)
    assert baseline["bytes"] == 6 * baseline["numel"]  # megatron: bf16 weight + fp32 master
    assert ours["bytes"] == 4 * ours["numel"]  # one 4-byte storage per parameter


def _state_of(opt):
    from mindspeed_like.features.reuse_fp32_param import state_of

    return state_of(W.inner_optimizers(opt)[0])


def _crafted_masters(opt):
    """Load masters whose every element is a tie or next to one (low half 0x8000, 0x7FFF, 0x8001)."""
    inner = W.inner_optimizers(opt)[0]
    state = inner.state_dict()
    lows = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x8000], dtype=torch.int32)
    crafted = []
    for group in state["fp32_from_fp16_params"]:
        new_group = []
        for p in group:
            words = p.detach().clone().view(torch.int32)
            low = lows.repeat(words.numel() // 4 + 1)[: words.numel()].view(words.shape)
            new_group.append(((words & ~0xFFFF) | low).view(torch.float32))
        crafted.append(new_group)
    state["fp32_from_fp16_params"] = crafted
    inner.load_state_dict(state)
    for model_param, master in zip((p for g in inner.float16_groups for p in g), (p for g in crafted for p in g)):
        model_param.data.copy_(master)  # as a model checkpoint would hold: the rounded master


def test_ties_round_to_even_through_training():
    """Masters full of exact ties: the bf16 weights must round them to even like megatron's copy,
    the round-down ties live in the side table, and training stays bitwise equal."""
    tables = []

    def count(model, opt):
        tables.append(_state_of(opt).side_table_bytes() // 8)

    def prepare(model, opt):
        _crafted_masters(opt)
        if _state_of(opt) is not None:
            count(model, opt)

    baseline = W.train(False, 5, prepare=prepare)
    ours = W.train(True, 5, prepare=prepare, after=count)
    assert W.same(baseline, ours)
    assert tables[0] > 1000  # about 1/4 of elements: even-high-half ties (low half 0x8000 on half the elements)


@pytest.mark.parametrize("chunk", [64, 1000])
def test_chunked_step_is_bitwise_with_ties_across_chunk_edges(chunk, monkeypatch):
    """megatron's torch AdamW steps the split layout chunk by chunk (no shuffle): small chunks put
    many chunk edges inside every parameter and the crafted ties on both sides of them; the
    shuffling conversion never runs."""
    from mindspeed_like.features.reuse_fp32_param import chunked_step
    from mindspeed_like.kernels import bf16_residual

    counts = {"chunked": 0, "shuffled": 0}
    real_step, real_to_fp32 = chunked_step.step, bf16_residual.to_fp32

    def counted_step(*args, **kwargs):
        counts["chunked"] += 1
        return real_step(*args, **kwargs)

    def counted_to_fp32(*args, **kwargs):
        counts["shuffled"] += 1
        return real_to_fp32(*args, **kwargs)

    monkeypatch.setattr(chunked_step, "step", counted_step)
    monkeypatch.setattr(bf16_residual, "to_fp32", counted_to_fp32)

    def prepare(model, opt):
        _crafted_masters(opt)
        if _state_of(opt) is not None:
            _state_of(opt).batch = chunk
        counts["shuffled"] = 0  # loading the crafted masters converts; the steps must not

    optimizer = dict(optimizer="adam", weight_decay=0.1)
    baseline = W.train(False, 5, prepare=prepare, optimizer=optimizer)
    ours = W.train(True, 5, prepare=prepare, optimizer=optimizer)
    assert W.same(baseline, ours)
    assert counts == {"chunked": 5, "shuffled": 0}


def test_chunked_step_runs_the_optimizers_step_hooks(monkeypatch):
    """torch's step hooks on the inner optimizer (fix-adam-state-without-step registers one on every
    torch Adam behind megatron) run once per step around the chunked step, as torch's step runs them."""
    from mindspeed_like.features.reuse_fp32_param import chunked_step

    chunked, calls = [], []
    real_step = chunked_step.step
    monkeypatch.setattr(chunked_step, "step", lambda *a, **k: chunked.append(1) or real_step(*a, **k))

    def prepare(model, opt):
        inner = W.inner_optimizers(opt)[0].optimizer  # torch's Adam behind megatron's optimizer
        inner.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
        inner.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))

    baseline = W.train(False, 3, prepare=prepare, optimizer=dict(optimizer="adam"))
    assert calls == ["pre", "post"] * 3 and not chunked
    calls.clear()
    ours = W.train(True, 3, prepare=prepare, optimizer=dict(optimizer="adam"))
    assert calls == ["pre", "post"] * 3 and len(chunked) == 3
    assert W.same(baseline, ours)


def _poison_third_step(model, opt, per_step: list) -> None:
    """Step 3's gradient gets an inf (after backward, before the found-inf check); every
    step's (success, masters, weights) is recorded."""
    inner = W.inner_optimizers(opt)[0]
    copy_grads = inner._copy_model_grads_to_main_grads
    step = opt.step

    def poisoned_copy():
        if len(per_step) == 2:
            next(p for g in inner.float16_groups for p in g).main_grad.view(-1)[0] = float("inf")
        return copy_grads()

    def recorded_step():
        out = step()
        per_step.append((out[0], W.masters_of(opt), W.weights_of(opt)))
        return out

    inner._copy_model_grads_to_main_grads = poisoned_copy
    opt.step = recorded_step


def test_skipped_step_leaves_weights_and_masters_consistent():
    """A constant loss scale turns on megatron's found-inf check; step 3 is skipped in both
    runs (masters and weights unchanged), weights stay the rounded masters, runs stay equal."""
    results = {}
    for flag in (False, True):
        per_step: list = []
        results[flag] = W.train(
            flag,
            5,
            prepare=lambda model, opt, per_step=per_step: _poison_third_step(model, opt, per_step),
            optimizer=dict(optimizer="adam", loss_scale=1.0),
        )
        results[flag]["per_step"] = per_step
    assert W.same(results[False], results[True])
    ours = results[True]["per_step"]
    assert [ok for ok, _, _ in ours] == [True, True, False, True, True]
    assert all(torch.equal(x, y) for x, y in zip(ours[1][1], ours[2][1]))  # masters unchanged
    assert all(torch.equal(x, y) for x, y in zip(ours[1][2], ours[2][2]))  # weights unchanged
    for _, masters, weights in ours:
        for m, w in zip(masters, weights):
            assert torch.equal(m.view(torch.float32).to(torch.bfloat16).view(torch.int16), w)


@pytest.mark.parametrize(
    "optimizer",
    [
        dict(optimizer="adam", clip_grad=1e-3, weight_decay=0.1),
        dict(optimizer="sgd", sgd_momentum=0.9, clip_grad=1e-3, weight_decay=0.1),
    ],
    ids=["adam-clip-wd", "sgd-momentum-clip-wd"],
)
def test_clipping_and_weight_decay_unchanged(optimizer):
    """Tight clipping (always active: grad norms are O(1)) and strong weight decay."""
    assert W.same(W.train(False, 6, optimizer=optimizer), W.train(True, 6, optimizer=optimizer))


def test_reload_model_params_sets_masters_to_the_weights():
    def reload(model, opt):
        opt.reload_model_params()
        return W.masters_of(opt), W.weights_of(opt)

    base = W.train(False, 4, after=reload)["after"]
    ours = W.train(True, 4, after=reload)["after"]
    for a, b in zip(base[0], ours[0]):
        assert torch.equal(a, b)
    for m, w in zip(*ours):
        assert torch.equal(m.view(torch.float32), w.view(torch.bfloat16).float())


@pytest.mark.slow
def test_checkpoint_round_trip_both_directions(tmp_path):
    """Train 3 steps, save (model + optimizer state_dict via torch.save), load in a *fresh process*
    with the flag on or off, train 3 more = 6 steps straight, bitwise; on disk the masters are
    plain fp32 tensors (4 bytes per element, no residual storage)."""
    first, total = 3, 6
    (saved,) = run_distributed(W.checkpoint_save, 1, str(tmp_path), first, total, timeout=300)
    assert saved["plain_True"] and saved["plain_False"]
    assert W.same(saved[True], saved[False])
    (loaded,) = run_distributed(W.checkpoint_load, 1, str(tmp_path), first, total, timeout=300)
    straight = saved["straight"]
    for pair, resumed in loaded.items():
        assert saved[pair[0]]["losses"] + resumed["losses"] == straight["losses"], pair
        assert W.equal(resumed["masters"], straight["masters"]), pair
        assert W.equal(resumed["weights"], straight["weights"]), pair


@pytest.mark.slow
def test_dp2_tp2_sp_and_other_features_bitwise():
    """2 gloo processes: DP=2 (Float16 optimizer), TP=2+SP, and TP=2+SP with the fused
    SwiGLU/RMSNorm/RoPE features on, each flag off vs on over 20 steps."""
    ranks = run_distributed(W.parallel_parity, 2, STEPS, timeout=600)
    for rank in ranks:
        for name, (base, ours) in rank.items():
            assert W.same(base, ours), name
            assert ours["bytes"] == 4 * ours["numel"], name


def test_flag_requires_bf16_fp32_optimizer():
    W.configure(True)
    init_parallel(seed=W.SEED)
    with pytest.raises(ConfigError, match=r"needs bf16 mixed-precision training.*FP32Optimizer.*--bf16"):
        train_steps(tiny_gpt(), 1)


def test_level_2_in_fp32_steps_aside_with_a_logged_fallback(caplog):
    """--optimization-level 2 means "where it applies": an fp32 run trains as megatron's, logged
    (the precision-check integration steps it aside when get_megatron_optimizer sees fp32)."""
    import mindspeed_like
    from mindspeed_like import runtime

    mindspeed_like.configure(device="cpu", optimization_level=2)
    init_parallel(seed=W.SEED)
    losses = train_steps(tiny_gpt(), 2)
    assert len(losses) == 2
    assert (
        "reuse-fp32-param (from --optimization-level 2) stepped aside: it acts only in bf16 training; "
        "this run trains in fp32" in caplog.text
    )
    assert "reuse-fp32-param" not in runtime.current_context().enabled_names
    mindspeed_like.reset()


def test_flag_requires_bf16_fp16_optimizer():
    W.configure(True)
    init_parallel(seed=W.SEED)
    with pytest.raises(ConfigError, match=r"needs bf16.*fp16"):
        train_steps(tiny_gpt(fp16=True, params_dtype=torch.float16), 1, bf16=False, optimizer=dict(fp16=True))


def test_megatron_lm_validate_args_requires_bf16():
    from types import SimpleNamespace

    from mindspeed_like.features.reuse_fp32_param.wrappers import bf16_required

    W.configure(True)
    with pytest.raises(ConfigError, match="--bf16 is not set"):
        with bf16_required(SimpleNamespace(bf16=False, reuse_fp32_param=True)):
            pass
    with bf16_required(SimpleNamespace(bf16=False, reuse_fp32_param=False)):  # on by --optimization-level
        pass
    with bf16_required(SimpleNamespace(bf16=True)):
        pass


def test_switching_off_restores_megatrons_methods():
    from megatron.core.optimizer import optimizer as megatron_optimizer

    cls = megatron_optimizer.Float16OptimizerWithFloat16Params
    names = ["__init__", "_copy_main_params_to_model_params", "state_dict", "load_state_dict"]
    W.configure(False)
    before = [cls.__dict__[n] for n in names] + [megatron_optimizer.MixedPrecisionOptimizer.step_with_ready_grads]
    mindspeed_like.configure(reuse_fp32_param=True)
    assert all(getattr(cls.__dict__[n], "__wrapped__", None) is b for n, b in zip(names, before))
    mindspeed_like.configure(reuse_fp32_param=False)
    after = [cls.__dict__[n] for n in names] + [megatron_optimizer.MixedPrecisionOptimizer.step_with_ready_grads]
    assert all(a is b for a, b in zip(before, after))


@pytest.mark.slow
def test_distributed_optimizer_dp2_bitwise_and_saves_2_bytes_per_param_per_dp():
    """DistributedOptimizer over 2 gloo ranks, with and without overlapped grad reduce: 20 steps
    bitwise equal; bytes of param buffer + master shards (+ residual shards and side tables)
    drop by 2/DP = 1 B/param; between steps the masters are back in the split layout."""
    ranks = run_distributed(W.distributed_optimizer, 2, STEPS, timeout=600)
    for rank in ranks:
        for name, (base, ours) in rank.items():
            assert base["losses"] == ours["losses"], name
            assert W.equal(base["after"]["masters"], ours["after"]["masters"]), name
            assert W.equal(base["weights"], ours["weights"]), name
            saved = (base["after"]["bytes"] - ours["after"]["bytes"]) / base["after"]["numel"]
            # 2 B/param/DP; the residual shard spans the rank's whole bucket shard, padding included
            # (megatron pads buckets to lcm(DP, 128) elements, params to 64), while megatron's master
            # shards cover only params: a few hundred elements either way in this tiny model
            assert abs(saved - 1.0) <= 0.01, (name, saved)
            assert ours["after"]["layout"] == "split"


@pytest.mark.slow
def test_distributed_optimizer_parameter_state_round_trip(tmp_path):
    """DP=2: train 3 steps, save megatron's DP-zero parameter state (get_parameter_state_dp_zero)
    with the model and optimizer state_dicts, load in fresh processes with the flag flipped
    (load_parameter_state_from_dp_zero), train 3 more = 6 straight, bitwise, both directions."""
    first, total = 3, 6
    saved = run_distributed(W.dist_checkpoint_save, 2, str(tmp_path), first, total, timeout=600)[0]
    loaded = run_distributed(W.dist_checkpoint_load, 2, str(tmp_path), first, total, timeout=600)[0]
    straight = saved["straight"]
    for pair, resumed in loaded.items():
        assert saved[pair[0]]["losses"] + resumed["losses"] == straight["losses"], pair
        assert W.equal(resumed["after"]["masters"], straight["after"]["masters"]), pair
        assert W.equal(resumed["weights"], straight["weights"]), pair


def test_distributed_optimizer_dp1_falls_back_with_one_log_line(caplog):
    """DP=1 leaves no dead region in the param buffer for the masters: megatron's layout, one
    warning, identical training; under --strict it is an error."""
    import logging

    args = dict(use_distributed_optimizer=True)
    base = W.train(False, 3, **args)
    with caplog.at_level(logging.WARNING, logger="mindspeed_like"):
        ours = W.train(True, 3, **args)  # one optimizer, three steps: one line
    assert base["losses"] == ours["losses"]
    lines = [r for r in caplog.records if "reuse-fp32-param" in r.getMessage()]
    assert len(lines) == 1 and "DP=1" in lines[0].getMessage()
    with pytest.raises(Exception, match="strict"):
        W.train(True, 1, features=dict(strict=True), **args)
