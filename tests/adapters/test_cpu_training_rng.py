"""cpu-training-loop: Megatron-LM's data-iterator setup does not move the generator dropout reads
(issue 37 item 0; the run through pretrain_gpt.py is tests/reliability/test_megatron_lm_resume_dropout.py)."""

from __future__ import annotations

import torch

from mindspeed_like import runtime
from mindspeed_like.adapters.cpu_training.patches import _isolated_rng, patches
from mindspeed_like.toolkit.targets import TRAINING_LOOP


def _build_iterators():
    """What megatron's build_train_valid_test_data_iterators does to the generator: iter(DataLoader)."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    return next(iter(loader))


def test_data_iterator_setup_is_wrapped_in_an_isolated_rng():
    wraps = {p.target: p.new for p in patches(runtime.current_context())}
    assert wraps[f"{TRAINING_LOOP}.build_train_valid_test_data_iterators"] is _isolated_rng


def test_isolated_setup_leaves_the_generator_where_a_checkpoint_restored_it():
    torch.manual_seed(7)
    restored = torch.get_rng_state()
    _build_iterators()
    assert not torch.equal(torch.get_rng_state(), restored), "iter(DataLoader) draws: the test would not fail"
    torch.set_rng_state(restored)
    assert _isolated_rng(_build_iterators, None, (), {}).tolist() == [0, 1]
    assert torch.equal(torch.get_rng_state(), restored)
