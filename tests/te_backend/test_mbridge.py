"""mbridge (verl's default Megatron <-> HF bridge) as a client on a CPU, issue 37 item 9 (b) and (c).

mbridge 0.15.1's specs ask for ``use_transformer_engine=True``; without TransformerEngine the
te-backend's classes build them. A tiny RANDOM HF Qwen3 and Qwen3-MoE (transformers configs,
``save_pretrained`` to a temp dir, no hub) go through
``AutoBridge.from_pretrained(path).get_model(weight_path=path, wrap_with_ddp=False,
use_cpu_initialization=True)`` as verl calls it, in bf16 (mbridge's default), with the import line
and ``--transfer-to-host`` (mbridge's own copy of megatron's ``get_model`` calls
``model_module.cuda(torch.cuda.current_device())``; item 9a):

* (b) the first forward died in ``scaled_masked_softmax_cuda`` (ModuleNotFoundError): mbridge's
  config has ``masked_softmax_fusion=True``, and the te-backend's ``TEDotProductAttention`` ran
  megatron's local attention, whose softmax asks for megatron's compiled CUDA extension in bf16.
  TE's attention never uses that extension; ours no longer routes to it.
* (c) logits equal HF's within bf16 rounding (HF's model in bf16 too; bound below), and three
  training steps on one batch lower the loss.

Opt-in: mbridge is not a dependency. ``make mbridge-smoke`` installs it (``--no-deps``: it declares
TE and more that these models do not import) with ``transformers<5`` and runs this file.
"""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch
from tiny_qwen3 import COMMON, hf_model

from mindspeed_like.testing import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mbridge") is None or importlib.util.find_spec("transformers") is None,
    reason="mbridge is not installed (opt-in lane: `make mbridge-smoke` installs mbridge 0.15.1 and transformers<5)",
)

# Both models compute in bf16 from the same weights: each matmul rounds its output to bf16 (relative
# 2**-8 = 3.9e-3), in a different order of operations in each model; over 2 layers the differences add
# up to a few units of bf16 rounding of the logits' scale. The issue measured 7.1e-3 (Qwen3) and 8.2e-3
# (Qwen3-MoE) with the checks of 9a/9b bypassed by hand.
LOGITS_RTOL = 2e-2  # max|diff| / max|HF logits|
STEPS = 3
# megatron's fused softmax takes 16 < seq <= 4096 with seq and batch x heads divisible by 4: the shape
# at which item 9b's ModuleNotFoundError was met (at 16 tokens megatron's own torch softmax runs)
SEQ = 32


def mbridge_worker(kinds: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="mbridge-") as root:  # the HF folders, removed after
        return _mbridge_worker(kinds, root)


def _mbridge_worker(kinds: list[str], root: str) -> dict:
    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401  (the user's import line)
    from mindspeed_like.testing.parallel import init_parallel

    mindspeed_like.configure(transfer_to_host=True)  # item 9a; from code, as verl sets its flags
    init_parallel(seed=1234)
    from mbridge import AutoBridge

    results: dict = {}
    for kind in kinds:
        hf = hf_model(kind)
        path = tempfile.mkdtemp(prefix=f"mbridge_{kind}_", dir=root)
        hf.save_pretrained(path)
        bridge = AutoBridge.from_pretrained(path)
        model = bridge.get_model(weight_path=path, wrap_with_ddp=False, use_cpu_initialization=True)
        gpt = model[0]
        out: dict = {
            "te_modules": sorted({type(m).__name__ for m in gpt.modules() if type(m).__name__.startswith("TE")}),
            "dtype": str(next(gpt.parameters()).dtype),
        }
        torch.manual_seed(1)
        tokens = torch.randint(0, COMMON["vocab_size"], (2, SEQ))
        positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
        gpt.eval()
        with torch.no_grad():
            reference = hf.to(torch.bfloat16)(tokens).logits.float()
            logits = gpt(input_ids=tokens, position_ids=positions, attention_mask=None).float()
        out["logits_rel_diff"] = ((logits - reference).abs().max() / reference.abs().max()).item()

        gpt.train()
        optimizer = torch.optim.Adam([p for p in gpt.parameters() if p.requires_grad], lr=1e-2)
        labels = torch.roll(tokens, -1, dims=1)
        losses = []
        for _ in range(STEPS + 1):  # the loss after three steps is the fourth forward's
            optimizer.zero_grad()
            loss = gpt(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels).float().mean()
            losses.append(loss.item())
            if len(losses) <= STEPS:
                loss.backward()
                optimizer.step()
        out["losses"] = losses
        results[kind] = out
    mindspeed_like.reset()
    return results


@pytest.fixture(scope="module")
def mbridge_results() -> dict:
    results = run_distributed(mbridge_worker, 1, ["qwen3", "qwen3_moe"], timeout=1800)[0]
    for kind in ("qwen3", "qwen3_moe"):  # the numbers, for the lane's log (pytest -s / -rA)
        out = results[kind]
        print(
            f"{kind}: logits max|diff|/max|HF| {out['logits_rel_diff']:.3g}; "
            f"losses {[round(x, 4) for x in out['losses']]}"
        )
    return results


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_mbridge_builds_the_te_spec_in_bf16(mbridge_results, kind):
    assert mbridge_results[kind]["dtype"] == "torch.bfloat16"
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= set(
        mbridge_results[kind]["te_modules"]
    )


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_mbridge_logits_equal_hf_within_bf16_rounding(mbridge_results, kind):
    assert mbridge_results[kind]["logits_rel_diff"] <= LOGITS_RTOL, mbridge_results[kind]["logits_rel_diff"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_three_training_steps_lower_the_loss(mbridge_results, kind):
    losses = mbridge_results[kind]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
