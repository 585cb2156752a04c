"""Why ms-swift's ``megatron sft --torch_dtype float16`` stops at iteration 1, shown on megatron alone.

ms-swift stops with megatron's ``found NaN in local grad norm for bucket #0`` (docs/clients.md,
"ms-swift megatron sft"). The NaN is megatron's dynamic loss scaling at work, not this project's:
the scaler starts at 2**32 (``OptimizerConfig.initial_loss_scale``), so the first fp16 backward
overflows (the fp16 logits' gradient is ``2**32 * (softmax - onehot)``, past fp16's 65504; the
matmuls after it meet infinities of both signs: NaN). That is the scaler's signal to skip the step
and lower the scale, which is why megatron-LM turns its NaN check off for fp16 with a dynamic scale
(``megatron/training/arguments.py``); ms-swift's ``wrap_model`` sets ``check_for_nan_in_grad=True``
whatever the precision. Here: megatron's local-spec GPT (no TE spec, no te-backend, this library not
imported) in a fresh interpreter, fp32 and fp16, backward of ms-swift's per-token loss sum at scale 1
and at 2**32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mindspeed_like.workloads.parallel import free_port

SCRIPT = r"""
import contextlib, json, os, sys
import torch
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import TransformerConfig

parallel_state.initialize_model_parallel()
# a CPU host: megatron's rope moves its frequencies to the CUDA device and its attention forks the
# CUDA rng tracker (dropout 0 here); nothing else of megatron's needs CUDA in this forward/backward
torch.cuda.current_device = lambda: "cpu"
megatron_random.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
loaded = sorted(m for m in sys.modules if m == "mindspeed_like" or m.startswith("mindspeed_like."))
found = {"mindspeed_like_modules": loaded, "runs": []}
for scale in (1.0, 2.0**32):
    for dtype in (torch.float32, torch.float16):
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
            ffn_hidden_size=128, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
            fp16=dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
            qk_layernorm=True,  # the spec's q/k norms (Qwen3's); megatron-core 0.19 refuses a spec the config lacks
        )
        torch.manual_seed(0)
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(config, spec, vocab_size=512, max_sequence_length=128, position_embedding_type="rope")
        ids = torch.randint(0, 512, (1, 26))
        mask = torch.ones(1, 1, 26, 26, dtype=torch.bool).triu(1)
        loss = model(ids, torch.arange(26)[None], mask, labels=ids)  # [b, s] per-token, fp32
        (loss.sum() * scale).backward()
        grads = [p.grad for p in model.parameters()]
        found["runs"].append(dict(
            dtype=str(dtype), scale=scale, loss=float(loss.sum()), params=len(grads),
            nonfinite=sum(not bool(torch.isfinite(g).all()) for g in grads),
            nan=sum(bool(torch.isnan(g).any()) for g in grads),
        ))
print("RESULT " + json.dumps(found))
"""


def test_megatron_fp16_first_backward_overflows_at_the_initial_loss_scale() -> None:
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env.pop("MINDSPEED_LIKE_AUTOLOAD", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT ") :])
    assert found["mindspeed_like_modules"] == []  # megatron's own path
    runs = {(r["dtype"], r["scale"]): r for r in found["runs"]}
    for key, run in runs.items():
        assert run["params"] > 10, key
        if key == ("torch.float16", 2.0**32):
            # every gradient NaN: what megatron's DDP check reports for bucket #0
            assert run["nan"] == run["params"], run
        else:
            assert run["nonfinite"] == 0, run
    # the same model in both precisions (the loss is computed in fp32 from the logits)
    assert abs(runs[("torch.float16", 1.0)]["loss"] - runs[("torch.float32", 1.0)]["loss"]) < 1e-2
