"""Megatron-LM's pretrain_gpt.py under the import line, with one patch of one fix taken out.

    torchrun ... tests/fsdp/megatron_lm_without_patch.py FEATURE TARGET pretrain_gpt.py ARGS...

Every feature is applied as usual (at the import line, and again once Megatron-LM's arguments are
parsed); after each time ``FEATURE`` keeps all its patches but the one on ``TARGET``, and the script runs
as ``mindspeed_like.run`` runs it: what megatron does without that patch
(tests/fsdp/test_fsdp_parallel_layouts.py)."""

import sys

from mindspeed_like import registry, run, runtime

feature_name, target, script, *args = sys.argv[1:]
feature = registry.feature_by_name(feature_name)
kept = [patch for patch in feature.patches if patch.target != target]
assert len(kept) < len(feature.patches), f"{feature_name} has no patch on {target}"
applied = runtime.apply


def apply_without_the_patch(*call_args, **call_kwargs):
    config = applied(*call_args, **call_kwargs)
    if feature_name in {record.feature for record in runtime.ENGINE.report()}:
        runtime.ENGINE.apply(feature_name, kept)
    return config


runtime.apply = apply_without_the_patch
print(f"> without {feature_name} on {target}", flush=True)
run.run_script(script, args)  # imports mindspeed_like.megatron_adaptor, then runs the script
