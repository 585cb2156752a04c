"""Train a tiny megatron-core GPTModel for a few steps and print the per-step losses as JSON.

    python tests/plain_megatron_run.py plain   WEIGHTS   # megatron-core WITHOUT mindspeed_like; saves WEIGHTS
    python tests/plain_megatron_run.py adaptor WEIGHTS   # `import mindspeed_like.megatron_adaptor`; loads WEIGHTS

Plain megatron-core cannot seed its RNG tracker or size its attention buffer on a host without
CUDA. For the reference run only, this throwaway process points the torch.cuda calls that the
model path makes (RNG state get/set, manual_seed, current_device) at the CPU: the smallest
change that lets untouched megatron code run. On a CPU-only torch that shim cannot restore RNG
states (torch.cuda._lazy_call queues the restore for a CUDA init that never comes), so the
two runs would draw different initial weights for a reason that is the shim's, not ours; the
adaptor run therefore starts from the weights the plain run drew, and dropout is off. What is
compared is then exactly megatron's model math (forward, backward, AdamW) with and without the
adaptor. The causal mask is passed in (megatron would build its own with device="cuda").
"""

import json
import sys

import torch

MODE, WEIGHTS = sys.argv[1], sys.argv[2]
if MODE == "adaptor":
    import mindspeed_like.megatron_adaptor  # noqa: F401
elif MODE == "plain":
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.current_device = lambda: torch.device("cpu")
else:
    raise SystemExit(f"mode must be 'plain' or 'adaptor', not {MODE!r}")

from mindspeed_like.testing import init_parallel, make_batches, tiny_gpt  # noqa: E402  (patches nothing)

STEPS = 5
init_parallel(seed=7)
model = tiny_gpt()
if MODE == "plain":
    torch.save(model.state_dict(), WEIGHTS)
else:
    model.load_state_dict(torch.load(WEIGHTS))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = make_batches(STEPS, 2, 32, 256, seed=8)
causal_mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
losses = []
for step in range(STEPS):
    tokens, labels = data[step, :, :-1], data[step, :, 1:]
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, position_ids, causal_mask, labels=labels).float().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(json.dumps({"losses": losses, "mindspeed_like_loaded": "mindspeed_like.runtime" in sys.modules}))
# Tear the gloo group down before the interpreter does: left to exit-time destruction, its threads
# sometimes abort the process ("terminate called without an active exception", seen once in the
# megatron-core 0.13.1 lane, in the plain run, after it had printed its losses).
torch.distributed.destroy_process_group()
