"""Megatron-LM's pretrain_gpt.py under the import line, Megatron-FSDP keeping each TP rank's own RNG states.

    torchrun ... tests/fsdp/megatron_lm_own_tp_rng.py pretrain_gpt.py ARGS...

Megatron-FSDP's wrapper broadcasts TP rank 0's RNG states (megatron's model-parallel tracker included) to
every TP rank at construction (``FullyShardedDataParallel.sync_rng_states_across_tp_group``, megatron's
choice, kept by the library); under sequence parallelism the whole transformer block and the embedding's
dropout draw from that tracker, so with dropout on the run cannot print the distributed optimizer's
digits. This launcher makes that broadcast do nothing (test only) so the rest of the run can be compared
digit for digit (tests/fsdp/test_fsdp_parallel_layouts.py). The patch waits for megatron's module to be
imported from the script's checkout (a post-import hook), as everything else the run imports.
"""

import sys

import wrapt

from mindspeed_like import run

ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"


def keep_each_ranks_rng(module) -> None:
    module.FullyShardedDataParallel.sync_rng_states_across_tp_group = lambda self: None


wrapt.register_post_import_hook(keep_each_ranks_rng, ADAPTER)
script, *args = sys.argv[1:]
print("> Megatron-FSDP without its TP RNG broadcast", flush=True)
run.run_script(script, args)
