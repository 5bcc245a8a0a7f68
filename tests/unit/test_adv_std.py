"""algo.adv_std: advantages divided by the sample std (the peers' convention, the default) or the
population std, against hand-worked numbers for G = 2, 4, 8, and the batch std across ranks."""
import math
import multiprocessing
import tempfile

import pytest
import torch

from common.config import AlgoConfig
from learner.grpo import compute_advantages

D = torch.float64
EPS = 1e-4


def test_sample_is_the_default():
    assert AlgoConfig().adv_std == "sample"
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=D)
    assert torch.equal(compute_advantages(rewards, 4), compute_advantages(rewards, 4, std="sample"))


# Each case: one group's rewards, then its sample std and population std worked out by hand.
# G=2, [1, 0]: mean 1/2, squared deviations 1/4 + 1/4 = 1/2; sample 1/2 / 1, population 1/2 / 2.
# G=4, [1, 0, 0, 0]: mean 1/4, 9/16 + 3 * 1/16 = 3/4; sample 3/4 / 3 = 1/4, population 3/16.
# G=8, [1, 1, 0 x 6]: mean 1/4, 2 * 9/16 + 6 * 1/16 = 3/2; sample 3/14, population 3/16.
HAND_WORKED = {
    2: ([1.0, 0.0], [0.5, -0.5], math.sqrt(1 / 2), 0.5),
    4: ([1.0, 0.0, 0.0, 0.0], [0.75, -0.25, -0.25, -0.25], 0.5, math.sqrt(3 / 16)),
    8: ([1.0, 1.0] + [0.0] * 6, [0.75, 0.75] + [-0.25] * 6, math.sqrt(3 / 14), math.sqrt(3 / 16)),
}


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("std", ["sample", "population"])
def test_group_std_hand_worked(G, std):
    rewards, centred, sample_std, population_std = HAND_WORKED[G]
    sd = sample_std if std == "sample" else population_std
    want = torch.tensor([c / (sd + EPS) for c in centred], dtype=D)
    got = compute_advantages(torch.tensor(rewards, dtype=D), G, scale="group", eps=EPS, std=std)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("G,ratio", [(2, 1.414), (4, 1.155), (8, 1.069)])
def test_population_over_sample_is_the_documented_ratio(G, ratio):
    """Without eps the two conventions differ by exactly sqrt(G/(G-1)), the ratio docs quote."""
    rewards = torch.tensor(HAND_WORKED[G][0] * 3, dtype=D)
    population = compute_advantages(rewards, G, eps=0.0, std="population")
    sample = compute_advantages(rewards, G, eps=0.0, std="sample")
    torch.testing.assert_close(population, sample * math.sqrt(G / (G - 1)), rtol=1e-14, atol=0)
    assert math.sqrt(G / (G - 1)) == pytest.approx(ratio, abs=5e-4)


@pytest.mark.parametrize("std", ["sample", "population"])
def test_batch_std_hand_worked(std):
    # Groups [1, 0] and [3, 3] (no signal: zeros). Batch [1, 0, 3, 3]: mean 7/4, squared
    # deviations 9/16 + 49/16 + 25/16 + 25/16 = 27/4; sample 27/4 / 3 = 9/4, population 27/16.
    sd = 1.5 if std == "sample" else math.sqrt(27 / 16)
    got = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=D), 2, scale="batch", eps=EPS, std=std)
    want = torch.tensor([0.5 / (sd + EPS), -0.5 / (sd + EPS), 0.0, 0.0], dtype=D)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


def test_unknown_std_is_refused():
    with pytest.raises(ValueError, match="std"):
        compute_advantages(torch.zeros(4), 2, std="biased")


def _global_std_rank(rank: int, store_file: str, shares, results) -> None:
    import torch.distributed as dist

    from learner.collectives import global_std

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        r = torch.tensor(shares[rank], dtype=torch.float32)
        results.put((rank, global_std(r, unbiased=True), global_std(r, unbiased=False)))
    finally:
        dist.destroy_process_group()


def test_global_std_spans_the_ranks():
    """The batch std of learner/update.py: both ranks' rewards together, in either convention,
    equal torch.std over the whole batch (not a mean of the per-rank stds)."""
    shares = [[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 0.5, 0.25, 2.0, 1.0]]
    import torch.distributed as dist

    # torch is imported already: a fork starts in ms. Not when this process holds a default
    # process group (an engine an earlier test built in it): a fork would inherit it.
    context = multiprocessing.get_context("spawn" if dist.is_initialized() else "fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        ranks = [context.Process(target=_global_std_rank, args=(rank, f"{folder}/store", shares, results))
                 for rank in range(2)]
        for process in ranks:
            process.start()
        got = [results.get(timeout=60) for _ in ranks]
        for process in ranks:
            process.join(timeout=60)
    everything = torch.tensor(shares[0] + shares[1], dtype=D)
    for _, sample, population in got:
        assert sample == pytest.approx(float(everything.std(unbiased=True)), rel=1e-6)
        assert population == pytest.approx(float(everything.std(unbiased=False)), rel=1e-6)
