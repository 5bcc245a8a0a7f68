"""How a minibatch is cut into micro-batches: rows sorted by length, each micro-batch within the
token budget once padded to its own longest row. One rank: the all-reduce that gives every rank
the same number of micro-batches is the identity (ranks together: tests/integration)."""
from __future__ import annotations

import pytest
import torch

from learner import batching
from learner.batching import MicroBatcher


@pytest.fixture
def world_of_one(monkeypatch):
    # Not a real process group: an xdist worker may hold one already from another test.
    monkeypatch.setattr(batching, "global_max", lambda value, device: value)


def _attention(lengths):
    attention = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
    return attention


def test_rows_of_like_length_share_a_micro_batch(world_of_one):
    lengths = [9, 3, 7, 3, 8, 2, 9, 4]
    micros = [m.tolist() for m in MicroBatcher(16, "cpu").split(torch.arange(8), _attention(lengths))]
    assert micros == [[5, 1, 3, 7], [2, 4], [0], [6]]
    padded = [len(m) * max(lengths[r] for r in m) for m in micros]
    assert all(p <= 16 for p in padded) and sum(padded) == 50  # rows in order: 6 micro-batches, 54 tokens
    assert sorted(r for m in micros for r in m) == list(range(8))


def test_a_subset_of_rows_keeps_its_own_indices_and_no_budget_keeps_one(world_of_one):
    lengths = [9, 3, 7, 3, 8, 2, 9, 4]
    rows = torch.tensor([6, 5, 2])
    assert [m.tolist() for m in MicroBatcher(14, "cpu").split(rows, _attention(lengths))] == [[5, 2], [6]]
    assert [m.tolist() for m in MicroBatcher(0, "cpu").split(rows, _attention(lengths))] == [[6, 5, 2]]


@pytest.mark.parametrize("budget", [0, 20, 40])
def test_what_the_plan_reads_back_once_is_what_each_micro_batch_would_read_itself(world_of_one, budget):
    """The plan's longest row, first target column and rows with targets, read back once per
    minibatch, equal what the update used to read from the device for each micro-batch (its
    attention's longest row, `first_target` of its trimmed targets, its rows that target any)."""
    from learner.logprobs import first_target

    gen = torch.Generator().manual_seed(5)
    lengths = [int(x) for x in torch.randint(4, 12, (10,), generator=gen)]
    attention = _attention(lengths)
    targets = torch.zeros(10, attention.shape[1] - 1, dtype=torch.bool)
    for row, length in enumerate(lengths):
        start = int(torch.randint(2, length - 1, (1,), generator=gen))  # a prompt of 2 or more tokens
        targets[row, start - 1:length - 1] = row % 4 != 3  # every fourth row trains on nothing
    rows = torch.tensor([9, 0, 3, 4, 7, 2, 8])
    micros = MicroBatcher(budget, "cpu").plan(rows, attention, targets)
    assert sorted(r for m in micros for r in m.rows.tolist()) == sorted(rows.tolist())
    for m in micros:
        T = int(attention[m.rows].sum(dim=1).max())
        assert m.length == T
        assert m.first_target == first_target(targets[m.rows, :T - 1])
        assert m.rows_with_targets == int(targets[m.rows].any(dim=1).sum())
        assert m.target_tokens == int(targets[m.rows, :T - 1].sum())
    assert any(m.first_target > 0 for m in micros)


def test_metrics_kept_on_the_device_sum_exactly_as_floats_read_each_time_did():
    """The update accumulates each micro-batch's metrics as float32 tensors and reads them once
    per step; the result must be what reading each as a python float (float64 arithmetic) and
    summing on the host gave, to the last bit (the resume test compares metrics exactly)."""
    from learner.update import _accumulate, host_floats

    gen = torch.Generator().manual_seed(3)
    micros = [{k: torch.rand((), generator=gen, dtype=torch.float32) * 3 for k in ("loss", "kl", "ratio_max")}
              for _ in range(7)]
    weights = [float(w) for w in torch.rand(7, generator=gen)]
    tokens = [int(t) for t in torch.randint(1, 300, (7,), generator=gen)]
    shares = [t / sum(tokens) for t in tokens]
    total: dict = {}
    for m, w, share in zip(micros, weights, shares):
        _accumulate(total, m, w, share)
    got = host_floats({**total, "micro_batches": 7.0})

    want = {"loss": 0.0, "kl": 0.0}
    for m, w, share in zip(micros, weights, shares):
        want["loss"] += w * float(m["loss"])
        want["kl"] += share * float(m["kl"])  # a token mean: by the micro-batch's share of the tokens
    want["ratio_max"] = max(float(m["ratio_max"]) for m in micros)
    assert got == {**want, "micro_batches": 7.0}
    assert all(type(v) is float for v in got.values())


def test_parts_of_a_step_combine_into_the_whole_batchs_metrics():
    """Minibatches and ranks with unequal token counts: token means weighted by tokens (the
    mean over every token), the largest ratio, the tokens summed, the rest plain means; the
    same for floats and for 0-dim tensors kept on the device."""
    from learner.metrics import combine_metrics

    gen = torch.Generator().manual_seed(11)
    rows = [torch.rand(n, generator=gen, dtype=torch.float64) for n in (5, 40, 1)]  # per-token entropies
    parts = [{"entropy": float(r.mean()), "ratio_max": float(r.max()), "loss": float(r.sum()),
              "loss_tokens": float(len(r))} for r in rows]
    every = torch.cat(rows)
    want = {"entropy": float(every.mean()), "ratio_max": float(every.max()),
            "loss": sum(p["loss"] for p in parts) / 3, "loss_tokens": 46.0}
    assert combine_metrics(parts) == pytest.approx(want, rel=1e-12)
    on_device = combine_metrics([{k: torch.tensor(v, dtype=torch.float64) for k, v in p.items()} for p in parts])
    assert {k: float(v) for k, v in on_device.items()} == pytest.approx(want, rel=1e-12)
    # no tokens anywhere (every completion masked out): every part counts alike, nothing divides by 0
    empty = [{**p, "loss_tokens": 0.0} for p in parts]
    assert combine_metrics(empty)["entropy"] == pytest.approx(sum(p["entropy"] for p in parts) / 3)
