"""The `reseed` path of rollout.seeded_sampling=false for both of vLLM's model runners."""
from __future__ import annotations

import numpy as np
import torch


def test_reseed_seeds_torch_and_numpys_global_rng_that_model_runner_v2_draws_request_seeds_from():
    from rollout.weight_receiver import WeightReceiver

    def draws():  # V2 gives an unseeded request np.random.randint(int64 min, int64 max) as its seed
        return int(np.random.randint(np.iinfo(np.int64).min, np.iinfo(np.int64).max, dtype=np.int64)), torch.rand(2)

    WeightReceiver.reseed(None, 2**40 + 5)  # call seeds are 64-bit: numpy takes them modulo 2**32
    first = draws()
    WeightReceiver.reseed(None, 2**40 + 5)
    again = draws()
    WeightReceiver.reseed(None, 2**40 + 6)
    other = draws()
    assert again[0] == first[0] and torch.equal(again[1], first[1])
    assert other[0] != first[0] and not torch.equal(other[1], first[1])
