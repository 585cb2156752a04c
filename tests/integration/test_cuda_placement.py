"""Placement on a GPU, checked on this CPU-only torch: every tensor where a one-GPU run has it.

``mindspeed_like.testing.fake_cuda`` runs megatron's and our code as on a one-GPU host (what it
proves and what not: its docstring). Here it runs, through the documented interfaces
(``configure(device="cuda")``, the demo's own functions, compare's worker), the demo's model
building and a whole training step (forward, backward, megatron's optimizer step) for the compare
presets at optimization levels 0-2, and compare's worker arms. On main before this check the demo
left the model on the host and died at the first forward on an H100 in megatron's RoPE
(``_apply_rotary_pos_emb_bshd``: cuda:0 and cpu); ``test_a_model_left_on_the_host_mixes_at_rope``
shows the check catches exactly that.
"""

from __future__ import annotations

import argparse
import traceback

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing.fake_cuda import DeviceMismatchError, fake_cuda, on_fake_cuda

PRESETS = ("llama", "moe", "qwen3-moe", "deepseek")
DEFAULT_CASES = {("llama", 2), ("moe", 1)}  # the representative subset in `make test`; the rest is slow
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2, steps=2)


@pytest.fixture
def fresh():
    """No feature applied before or after (the cuda configuration must not outlive the test)."""
    from mindspeed_like.testing import destroy_parallel

    mindspeed_like.reset()
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _demo_step(preset: str, level: int | None, *, move: bool = True) -> list[float]:
    """The demo's code path (its size arguments at a tiny size) on device cuda: configure (unless
    ``level`` is None: as configured), build, place, train ``steps`` steps with megatron's DDP and
    optimizer."""
    from mindspeed_like import demo, runtime
    from mindspeed_like.runtime import enabled_feature_names
    from mindspeed_like.testing import init_parallel, train_steps

    if level is not None:
        mindspeed_like.configure(device="cuda", optimization_level=level)
    config = runtime.current_config()
    args = argparse.Namespace(**TINY, bf16=bool(level and level >= 2), why=None)
    size = demo.demo_size(args, "cuda")
    init_parallel(seed=1234)
    model = demo.build_model(preset, size, enabled_feature_names(config))
    target = None
    if move:
        model, target = demo.place_on_device(model, "cuda")
        assert all(on_fake_cuda(p) for p in model.parameters())
    return train_steps(
        model, size.steps, micro_batch_size=size.micro_batch_size, seq_length=size.seq_length, device=target
    )


def _matrix():
    for preset in PRESETS:
        for level in (0, 1, 2):
            marks = () if (preset, level) in DEFAULT_CASES else (pytest.mark.slow,)
            yield pytest.param(preset, level, marks=marks, id=f"{preset}-level{level}")


@pytest.mark.parametrize("preset, level", _matrix())
def test_the_demo_trains_on_a_gpu_with_every_tensor_there(fresh, preset, level):
    with fake_cuda():
        losses = _demo_step(preset, level)
    assert len(losses) == TINY["steps"] and all(torch.isfinite(torch.tensor(losses)))


def test_the_demo_command_runs_on_a_gpu(fresh, capsys):
    """`mindspeed-like demo --device cuda` as a user types it (tiny sizes), the CLI in this process."""
    from mindspeed_like import cli

    size = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    with fake_cuda():
        assert cli.main(["demo", "--device", "cuda", "--optimization-level", "1", "--preset", "moe", *size]) == 0
    out = capsys.readouterr().out
    assert "demo on cuda" in out and "summary:" in out and "cuda allocator" in out, out


def test_megatrons_fused_softmax_flag_trains_on_a_gpu_without_the_extension(fresh):
    """masked_softmax_fusion in bf16 (Megatron-LM's default) on megatron's own attention: the compiled
    extension is absent, megatron's unfused softmax runs (fix-masked-softmax-without-extension)."""
    from mindspeed_like.testing import init_parallel, tiny_gpt, train_steps

    with fake_cuda():
        mindspeed_like.configure(device="cuda", optimization_level=0)
        init_parallel()
        model = tiny_gpt(bf16=True, masked_softmax_fusion=True).to(torch.device("cuda", 0))
        assert train_steps(model, 1, micro_batch_size=2, seq_length=32, device=torch.device("cuda", 0))


def test_a_model_left_on_the_host_mixes_at_rope(fresh):
    """What the demo did before (model built on the host, batches on the host, device cuda):
    megatron's RotaryEmbedding moved its frequencies to torch.cuda.current_device() and the first
    forward mixed them with the host activations, as the user's H100 run did."""
    with fake_cuda(), pytest.raises(DeviceMismatchError, match="cuda:0 and cpu") as caught:
        _demo_step("llama", 0, move=False)
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "_apply_rotary_pos_emb_bshd" in frames, frames


def test_moe_router_without_transformer_engine_runs_on_a_gpu(fresh):
    """megatron's own MoE path on a GPU without TE (compare's megatron arm on the H100 died with
    NameError: te_general_gemm, megatron-core 0.16.1): fix-moe-router-without-te makes it run;
    without it, the NameError. From 0.17 megatron binds the name to None and runs on its own."""
    from packaging.version import Version

    from mindspeed_like import runtime
    from mindspeed_like.fixes import router_gating_without_te
    from mindspeed_like.megatron_version import megatron_core_version

    with fake_cuda():
        assert _demo_step("moe", 0)
        runtime.ENGINE.remove(router_gating_without_te.FEATURE.name)  # megatron's own behaviour
        if megatron_core_version() >= Version("0.17"):
            assert _demo_step("moe", None)
            return
        with pytest.raises(NameError, match="te_general_gemm"):
            _demo_step("moe", None)


def _worker_spec(arm: str, preset: str, level: int) -> dict:
    """A compare arm's spec as `mindspeed-like compare --device cuda` hands it to the worker."""
    from mindspeed_like.compare.worker import FEATURES
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows

    size = {k: TINY[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")}
    generator = torch.Generator().manual_seed(1234)
    tokens = megatron_source_bytes()
    data = torch.stack([sample_windows(tokens, 2, TINY["seq_length"], generator) for _ in range(2)])
    return dict(
        arm=arm,
        device="cuda",
        flags=dict(device="cuda", optimization_level=level) if arm == FEATURES else {},
        shared_flags={},
        preset=preset,
        size=size,
        tp=1,
        pp=1,
        ep=1,
        cp=1,
        vpp=None,
        sp=False,
        bf16=True,
        transformer_impl="transformer_engine",
        seed=1234,
        steps=2,
        micro_batch_size=2,
        microbatches=1,
        lr=3e-3,
        distributed_optimizer=False,
        data=data,
        progress=False,
        threads=1,
        repeats=1,
    )


@pytest.mark.parametrize(
    "preset", [pytest.param("moe"), *(pytest.param(p, marks=pytest.mark.slow) for p in PRESETS if p != "moe")]
)
def test_compare_worker_arms_run_on_a_gpu(fresh, monkeypatch, preset):
    """compare's worker (build, move, train) in both arms: megatron's own path and the features at level 1."""
    from mindspeed_like.compare.worker import FEATURES, MEGATRON, run_arm
    from mindspeed_like.testing import init_parallel

    # what the worker changes in its own process (a child of compare's): the command line, the
    # environment's flags for megatron's arm, the thread count
    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with fake_cuda():
        init_parallel()  # the default process group run_distributed makes for each arm
        for arm in (MEGATRON, FEATURES):
            result = run_arm(_worker_spec(arm, preset, level=1))
            assert result["device"] == "cuda" and len(result["losses"]) == 2, result
            mindspeed_like.reset()
