"""DeepSpeed for real: one GRPO step on the same batch is the same step for 1 or 2 data-parallel
ranks, ZeRO stages 0-3 and micro-batching, and it is the GRPO gradient a plain PyTorch
computation of the loss gives.

What the ranks and stages must agree on is the reduced gradient. It is compared before any
optimizer can amplify rounding: the runs use plain SGD (`learner.optimizer=sgd`, lr 1), whose
update is the (clipped) gradient itself, and the test measures the largest difference of any
element relative to the largest gradient element. Reduction-order rounding in fp32 moves that
by about 1e-6 (at most 2e-6 seen); the tolerance is 1e-4; each known wrong implementation moves
it by 1.4e-2 (ranks normalising by their own token counts) to 1.1 (a missing all-reduce), which
`test_known_wrong_implementations_fail` shows on the same batch.

AdamW's first step is about lr * g / (|g| + eps): it turns rounding in gradients near zero into
whole-lr differences. The one end-to-end AdamW check therefore bounds each element by what
that map can do to the gradient difference the SGD check allows (see `_adam_tolerance`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import ray
import torch

from common import state_files
from learner import corrections, grpo
from learner_pool import probe, checkpointed_blocks, reference_numel, reference_state, state_copy
from helpers import varied_groups


G = 4
SGD_LR = 1.0       # the update is -clip(g): the gradient, read off the weights
ADAM_LR = 1e-3
ADAM_EPS = 1e-8    # torch.optim.AdamW's default, which the learner uses
GRAD_RTOL = 1e-4   # rounding gave up to 2e-6 here; the wrong implementations 1.4e-2 to 1.1
# DAPO-style settings whose normalisation depends on how tokens are split over ranks.
DAPO = dict(loss_agg="token-mean", mask_truncated=True, overlong_buffer=4, overlong_penalty=0.5,
            clip_high=0.28, beta=0.0, max_length=10)  # completions of 2-9 tokens: 7-9 are penalised


def _one_step(learners, cfg, groups, num_ranks: int, zero_stage: int, micro_tokens: int = 0,
              optimizer: str = "sgd", minibatches: int = 1, lr: float = 0.0, learner_settings=None, **algo):
    """One real GRPO step of a learner built for these settings (`learners`: the module's
    pool; `learner_settings`: more LearnerConfig fields); returns the update per unit of lr
    (for SGD: the clipped gradient), the metrics, and the weights before the step."""
    lr = lr or (SGD_LR if optimizer == "sgd" else ADAM_LR)
    learner_cfg = replace(cfg.learner, num_ranks=num_ranks, zero_stage=zero_stage, minibatches=minibatches,
                          num_cpus_per_rank=0.1,
                          max_tokens_per_microbatch=micro_tokens, optimizer=optimizer, **(learner_settings or {}))
    max_length = algo.pop("max_length", cfg.rollout.max_new_tokens)
    algo_cfg = replace(cfg.algo, **algo)
    with learners.learner(cfg.model.path, learner_cfg, algo_cfg, max_length, cfg.trainer.seed) as learner:
        if learner_settings and learner_settings.get("gradient_checkpointing"):  # on for real, every block
            layers = json.loads((Path(cfg.model.path) / "config.json").read_text())["num_hidden_layers"]
            assert probe(learner, checkpointed_blocks) == [layers] * num_ranks
        learner.snapshot_reference()
        before = probe(learner, state_copy)[0]  # a collective under ZeRO-3: every rank joins
        metrics = learner.train_step([ray.put(g) for g in groups], 1.0, lr)
        states = probe(learner, state_copy)
    for other in states[1:]:  # every rank holds the same full model after the step
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])
    update = {k: (before[k] - states[0][k]) / lr for k in before}
    return update, metrics, before


def mismatch(update: dict, reference: dict) -> float:
    """Largest element-wise difference, relative to the reference's largest element."""
    assert update.keys() == reference.keys()
    scale = max(float(v.abs().max()) for v in reference.values())
    assert scale > 0, "the reference step changed nothing"
    return max(float((update[k] - reference[k]).abs().max()) for k in reference) / scale


def assert_same_gradient(update: dict, reference: dict) -> None:
    error = mismatch(update, reference)
    assert error <= GRAD_RTOL, f"gradients differ by {error:.2e} of the largest element (allowed {GRAD_RTOL:.0e})"


# ---- the same loss in plain PyTorch, right and wrong -------------------------------------
class PlainGRPO:
    """The learner's GRPO loss for one optimizer step, in one process without DeepSpeed:
    the correct gradient and the gradients of known mistakes."""

    def __init__(self, model_path: str, groups, clip: float, **algo):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.algo, self.clip = algo, clip
        seqs = [list(g.prompt_ids) + list(c) for g in groups for c in g.completion_ids]
        starts = [len(g.prompt_ids) for g in groups for _ in g.completion_ids]
        length = max(map(len, seqs))
        self.ids = torch.zeros((len(seqs), length), dtype=torch.long)
        self.attention = torch.zeros_like(self.ids)
        self.mask = torch.zeros((len(seqs), length - 1), dtype=torch.bool)
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            self.ids[i, :len(seq)] = torch.tensor(seq)
            self.attention[i, :len(seq)] = 1
            self.mask[i, start - 1:len(seq) - 1] = True
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        self.A = grpo.compute_advantages(rewards, G, scale="group", eps=1e-4)

    def logprobs(self, rows) -> torch.Tensor:
        rows = torch.as_tensor(rows)
        logits = self.model(input_ids=self.ids[rows], attention_mask=self.attention[rows]).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, self.ids[rows, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def entropy(self) -> float:
        """The policy's entropy, a mean over every completion token of the batch."""
        logits = self.model(input_ids=self.ids, attention_mask=self.attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        return float(-(logp.exp() * logp).sum(-1)[self.mask].mean())

    def loss(self, rows, num_tokens=None, is_weights=None):
        rows = torch.as_tensor(rows)
        logprobs = self.logprobs(rows)
        loss, _ = grpo.policy_loss(logprobs, logprobs.detach(), logprobs.detach(), self.A[rows], self.mask[rows],
                                   num_tokens=num_tokens, is_weights=None if is_weights is None else is_weights[rows],
                                   **self.algo)
        return loss

    def sgd_passes(self, minibatches: int, iterations: int, lr: float, sampler: torch.Tensor, cap: float) -> dict:
        """The learner's update in plain PyTorch: pi_old = pi_ref = the model before any step,
        the importance weights from pi_old, then `iterations` passes of clipped SGD steps, one
        per minibatch in order. Returns the change of the weights per unit of lr."""
        rows = torch.arange(len(self.ids))
        with torch.no_grad():
            old = self.logprobs(rows)
        weights = grpo.truncated_is_weights(old, sampler, self.mask, cap)[0]
        before = {k: p.detach().clone() for k, p in self.model.named_parameters()}
        for _ in range(iterations):
            for mb in rows.chunk(minibatches):
                loss, _ = grpo.policy_loss(self.logprobs(mb), old[mb], old[mb], self.A[mb], self.mask[mb],
                                           is_weights=weights[mb], **self.algo)
                grads = self.gradient([(1.0, loss)])
                with torch.no_grad():
                    for k, p in self.model.named_parameters():
                        p -= lr * grads[k]
        out = {k: (before[k] - p.detach()) / lr for k, p in self.model.named_parameters()}
        if "lm_head.weight" not in out:  # tied: one tensor
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def gradient(self, losses) -> dict:
        """The gradient of sum(weight * loss) over (weight, loss) pairs, clipped like the learner's."""
        self.model.zero_grad()
        for weight, loss in losses:
            (weight * loss).backward()
        grads = {k: p.grad.detach().clone() for k, p in self.model.named_parameters()}
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        scale = min(1.0, self.clip / (norm + 1e-6))
        out = {k: grads[k] * scale for k in grads}
        if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:  # tied: one tensor
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch(system_cfg):
    vocab = json.loads((Path(system_cfg.model.path) / "config.json").read_text())["vocab_size"]
    return varied_groups(vocab, G)


@pytest.fixture(scope="module")
def reference(learners, system_cfg, batch):
    return _one_step(learners, system_cfg, batch, 1, 2)


@pytest.fixture(scope="module")
def plain_entropy(system_cfg, batch) -> float:
    return _plain(system_cfg, batch).entropy()


def _algo(cfg, **override) -> dict:
    a = {**asdict(cfg.algo), **override}
    return dict(clip_low=a["clip_low"], clip_high=a["clip_high"], beta=a["beta"], kl_estimator=a["kl_estimator"],
                loss_agg=a["loss_agg"])


def _plain(cfg, batch, **override) -> PlainGRPO:
    return PlainGRPO(cfg.model.path, batch, cfg.learner.grad_clip, **_algo(cfg, **override))


# ---- the tests ---------------------------------------------------------------------------
def test_one_rank_step_is_the_plain_grpo_gradient(system_cfg, batch, reference):
    update, _, _ = reference
    plain = _plain(system_cfg, batch)
    assert_same_gradient(update, plain.gradient([(1.0, plain.loss(range(len(plain.ids))))]))


@pytest.mark.parametrize("num_ranks, zero_stage, micro_tokens", [
    (2, 2, 0), (2, 3, 0), (2, 0, 0), (2, 1, 0),
    (1, 2, 30), (2, 2, 30), (2, 3, 30),  # micro-batches of at most 30 padded tokens, accumulated
])
def test_same_gradient_for_any_rank_count_zero_stage_and_micro_batching(learners, system_cfg, batch, reference,
                                                                         plain_entropy, num_ranks, zero_stage,
                                                                         micro_tokens):
    update, metrics, _ = reference
    other, other_metrics, _ = _one_step(learners, system_cfg, batch, num_ranks, zero_stage, micro_tokens)
    assert_same_gradient(other, update)
    assert other_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    assert other_metrics["micro_batches"] > 1 if micro_tokens else other_metrics["micro_batches"] == 1
    # The metrics are the whole batch's, however it is cut: the entropy is the token mean (length-
    # sorted micro-batches averaged alike gave the longest rows' micro-batch the weight of all others).
    assert metrics["entropy"] == pytest.approx(plain_entropy, rel=1e-5)
    assert other_metrics["entropy"] == pytest.approx(plain_entropy, rel=1e-5)
    assert other_metrics["loss_tokens"] == metrics["loss_tokens"] == sum(len(c) for g in batch for c in g.completion_ids)


@pytest.mark.parametrize("num_ranks, zero_stage, micro_tokens", [(1, 2, 0), (2, 3, 30)])
def test_gradient_checkpointing_gives_the_same_step(learners, system_cfg, batch, reference, num_ranks, zero_stage,
                                                    micro_tokens):
    """Recomputing each block's activations in the backward pass (under ZeRO-3 too, where the
    recompute gathers the block's parameters again) changes no gradient and no loss."""
    update, metrics, _ = reference
    other, other_metrics, _ = _one_step(learners, system_cfg, batch, num_ranks, zero_stage, micro_tokens,
                                        learner_settings={"gradient_checkpointing": True})
    assert_same_gradient(other, update)
    assert other_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)


def _adam_tolerance(gradient: dict, weights: dict):
    """Per-element bound on how far two AdamW first steps (per unit of lr) may differ when
    their gradients differ by at most GRAD_RTOL * max|g|.

    The first AdamW step is u(g) = g / (|g| + eps) (bias-corrected moments are g and g^2), with
    |du/dg| = eps / (|g| + eps)^2. Where |g| >= tau = 10 * GRAD_RTOL * max|g| the gradient cannot
    change sign, and |du| <= eps * GRAD_RTOL * max|g| / (|g| - GRAD_RTOL * max|g|)^2. Below tau
    only |u| <= 1 holds, so two steps differ by at most 2. Plus fp32 rounding in each run: of
    AdamW's own arithmetic (a few ulps of |u| <= 1: 2**-21 for both runs) and of w - lr * u
    (half an ulp of |w| each: 2**-24 * |w| / lr together); both bounds are doubled for margin.
    """
    scale = max(float(g.abs().max()) for g in gradient.values())
    dg = GRAD_RTOL * scale
    bounds = {}
    for k, g in gradient.items():
        a = g.abs().double()
        sure = a >= 10 * dg
        bound = torch.where(sure, ADAM_EPS * dg / (a - dg).clamp(min=1e-30) ** 2, torch.full_like(a, 2.0))
        bounds[k] = bound + 2.0 ** -20 + 2.0 ** -23 * weights[k].abs().double() / ADAM_LR
    return bounds


def test_same_adamw_step_end_to_end(learners, system_cfg, batch, reference):
    gradient, _, _ = reference  # the clipped gradient AdamW gets
    one, _, weights = _one_step(learners, system_cfg, batch, 1, 2, optimizer="adamw")
    two, _, _ = _one_step(learners, system_cfg, batch, 2, 3, micro_tokens=30, optimizer="adamw")
    bounds = _adam_tolerance(gradient, weights)
    confident = sum(int((b < 1).sum()) for b in bounds.values())
    total = sum(b.numel() for b in bounds.values())
    assert confident > 0.5 * total, "most gradient elements should be well away from zero"
    for k in one:
        diff = (one[k] - two[k]).abs().double()
        assert (diff <= bounds[k]).all(), f"{k}: AdamW steps differ by {float((diff - bounds[k]).max()):.2e} over the bound"
    assert any(float(u.abs().max()) > 0.5 for u in one.values()), "AdamW's first step moves weights by about lr"


def test_dapo_token_mean_is_normalised_over_the_whole_batch(learners, system_cfg, batch):
    # The two ranks hold different numbers of tokens: dividing each rank's sum by its own count
    # would weight tokens differently than one rank does; the global count makes them agree.
    one, one_metrics, _ = _one_step(learners, system_cfg, batch, 1, 2, **DAPO)
    two, two_metrics, _ = _one_step(learners, system_cfg, batch, 2, 2, **DAPO)
    assert_same_gradient(two, one)
    micro, _, _ = _one_step(learners, system_cfg, batch, 2, 2, micro_tokens=30, **DAPO)
    assert_same_gradient(micro, one)
    assert one_metrics["overlong_penalty_mean"] == pytest.approx(two_metrics["overlong_penalty_mean"])
    assert one_metrics["overlong_penalty_mean"] < 0  # some completions reach the buffer


def _sampled_by_another(cfg, batch, seed: int = 3):
    """The batch as if a sampler with other numbers than the learner's drew it: each completion
    token's sampler log-prob is the model's own plus noise (some weights capped, some below 1)."""
    plain = _plain(cfg, batch)
    with torch.no_grad():
        own = plain.logprobs(range(len(plain.ids)))
    sampler = torch.where(plain.mask, own + 0.5 * torch.randn(own.shape, generator=torch.Generator().manual_seed(seed)),
                          torch.zeros_like(own))
    groups, row = [], 0
    for g in batch:
        start = len(g.prompt_ids) - 1
        lps = [sampler[row + j, start:start + len(c)].tolist() for j, c in enumerate(g.completion_ids)]
        groups.append(replace(g, sampler_logprobs=lps))
        row += len(g.completion_ids)
    return groups, sampler


def test_importance_weights_of_the_first_minibatch_come_from_its_own_forward(learners, system_cfg, batch):
    """pi_old is not computed for the rows trained before any optimizer step: their own
    log-probs, detached, are pi_old, and their truncated importance weights come from them."""
    groups, sampler = _sampled_by_another(system_cfg, batch)
    plain = _plain(system_cfg, batch)
    rows = range(len(plain.ids))
    with torch.no_grad():
        own = plain.logprobs(rows)
    weights, whole = grpo.truncated_is_weights(own, sampler, plain.mask, 2.0)
    assert 0 < whole["is_capped_fraction"] < 0.5 and whole["sampler_logprob_gap"] > 0.1
    half = len(own) // 2  # the ranks' shares have unequal token counts: a plain mean of theirs is not the batch's
    shares = [grpo.truncated_is_weights(own[s], sampler[s], plain.mask[s], 2.0)[1]
              for s in (slice(0, half), slice(half, None))]
    assert {k: sum(m[k] for m in shares) / 2 for k in whole} != pytest.approx(whole, rel=1e-3)
    gradient = plain.gradient([(1.0, plain.loss(rows, is_weights=weights))])
    without = plain.gradient([(1.0, plain.loss(rows))])
    assert mismatch(without, gradient) > 10 * GRAD_RTOL, "the weights should change this gradient"
    for ranks, stage, micro in [(1, 2, 0), (2, 3, 30)]:
        update, metrics, _ = _one_step(learners, system_cfg, groups, ranks, stage, micro, is_cap=2.0)
        assert_same_gradient(update, gradient)
        for key, value in whole.items():  # the whole batch's token means, for any number of ranks
            assert metrics[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("correction, bounds", [("mis", {}), ("icepop", {}),
                                               ("seq_mask", {"seq_mask_low": 0.9, "seq_mask_high": 1.1})])
def test_each_correction_weights_the_real_step_by_its_formula(learners, system_cfg, batch, correction, bounds):
    """MIS, IcePop and the sequence mask (learner/corrections.py) in a real step, micro-batched
    over 2 ranks: the plain gradient with their weights, and the masked share they log."""
    groups, sampler = _sampled_by_another(system_cfg, batch)
    plain = _plain(system_cfg, batch)
    rows = range(len(plain.ids))
    with torch.no_grad():
        own = plain.logprobs(rows)
    algo = replace(system_cfg.algo, correction=correction, **bounds)
    weights = corrections.weights(algo, own, sampler, plain.mask)
    masked = float((weights[plain.mask] == 0).float().mean())
    assert 0 < masked < 1, masked
    gradient = plain.gradient([(1.0, plain.loss(rows, is_weights=weights))])
    update, metrics, _ = _one_step(learners, system_cfg, groups, 2, 2, 30, correction=correction, **bounds)
    assert_same_gradient(update, gradient)
    assert metrics[f"masked_fraction_{correction}"] == pytest.approx(masked, abs=1e-6)
    assert metrics["mismatch_k3"] > 0 and metrics["mismatch_chi2"] > 0


@pytest.mark.parametrize("num_ranks, zero_stage, micro_tokens", [(1, 2, 0), (2, 3, 60)])
def test_packed_sequences_give_the_padded_gradient(learners, system_cfg, batch, num_ranks, zero_stage, micro_tokens):
    """learner.pack_sequences: each micro-batch's rows packed into bins (position ids
    restarting per sample, no attention mask): the gradient of the padded plain step."""
    plain = _plain(system_cfg, batch)
    gradient = plain.gradient([(1.0, plain.loss(range(len(plain.ids))))])
    update, metrics, _ = _one_step(learners, system_cfg, batch, num_ranks, zero_stage, micro_tokens,
                                   learner_settings={"pack_sequences": True})
    assert_same_gradient(update, gradient)
    assert 0 <= metrics["padded_fraction"] < 1


def test_later_minibatches_and_passes_use_pi_old_from_before_the_first_step(learners, system_cfg, batch):
    """Two minibatches, two passes: the first minibatch's pi_old, taken from its own forward,
    is what the second pass uses too, as pi_old computed before any step would be."""
    groups, sampler = _sampled_by_another(system_cfg, batch)
    lr = 0.05
    update, _, _ = _one_step(learners, system_cfg, groups, 1, 2, minibatches=2, lr=lr, is_cap=2.0, num_iterations=2)
    expected = _plain(system_cfg, batch).sgd_passes(2, 2, lr, sampler, 2.0)
    assert_same_gradient(update, expected)


def test_reported_metrics_are_the_whole_batchs_however_it_is_cut_into_micro_batches(learners, system_cfg, batch):
    """Two minibatches with a step between them, so that the second has a KL, ratios away from 1
    and clipping: what the step reports is the same in one micro-batch and in micro-batches of
    at most 20 or 30 padded tokens (rows sorted by length, so each holds its own kind of row):
    token means weighted by their tokens, the largest ratio the largest. (A plain mean over the
    micro-batches differs: it gives a micro-batch of a few long rows the weight of all others.)"""
    runs = [_one_step(learners, system_cfg, batch, 1, 2, micro, minibatches=2, lr=SGD_LR)[1] for micro in (0, 20, 30)]
    whole = runs[0]
    assert whole["kl"] > 1e-4 and abs(whole["ratio_mean"] - 1) > 1e-4 and whole["clip_fraction"] > 0, whole
    for metrics in runs[1:]:
        assert metrics["micro_batches"] > 2
        for key in ("kl", "ratio_mean", "clip_fraction", "entropy", "ratio_max", "loss_tokens"):
            assert metrics[key] == pytest.approx(whole[key], rel=1e-5), key


def test_known_wrong_implementations_fail(learners, system_cfg, batch, reference):
    """The comparison above has the power to catch the bugs it is for, on this very batch."""
    rows = list(range(len(batch) * G))
    half = len(rows) // 2  # rank r of 2 holds whole groups: rows [r*half, (r+1)*half)
    shards = [rows[:half], rows[half:]]

    # token-mean over 2 ranks: the real learner equals the global-count gradient...
    token_mean, _, _ = _one_step(learners, system_cfg, batch, 2, 2, loss_agg="token-mean")
    plain = _plain(system_cfg, batch, loss_agg="token-mean")
    assert_same_gradient(token_mean, plain.gradient([(1.0, plain.loss(rows))]))
    tokens = float(plain.mask.sum())
    wrong = {
        # ...not each rank's own mean, averaged over ranks
        "own token count per rank": plain.gradient([(0.5, plain.loss(s)) for s in shards]),
        # ...nor rank 0's gradient alone (no all-reduce)
        "no gradient all-reduce": plain.gradient([(1.0, plain.loss(shards[0], num_tokens=tokens / 2))]),
    }
    # seq-mean-token-mean in micro-batches of unequal rows: weighted by rows, not equally.
    update, _, _ = reference
    plain = _plain(system_cfg, batch)
    micros = [rows[:3], rows[3:]]
    assert_same_gradient(update, plain.gradient([(len(m) / len(rows), plain.loss(m)) for m in micros]))
    wrong["micro-batches weighted equally"] = plain.gradient([(1 / len(micros), plain.loss(m)) for m in micros])

    for name, gradient in wrong.items():
        reference_update = token_mean if name != "micro-batches weighted equally" else update
        error = mismatch(gradient, reference_update)
        assert error > 10 * GRAD_RTOL, f"{name}: only {error:.2e} from the right gradient"


def test_zero3_reference_is_sharded_and_survives_a_checkpoint(learners, system_cfg, tmp_path):
    """Under ZeRO-3 each rank holds only its shard of pi_ref, as of the policy, copied shard to
    shard from the policy's; a checkpoint saves the full reference and loading it shards it again."""
    learner_cfg = replace(system_cfg.learner, num_ranks=2, zero_stage=3, num_cpus_per_rank=0.1,
                          deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    with learners.learner(system_cfg.model.path, learner_cfg, system_cfg.algo, system_cfg.rollout.max_new_tokens,
                          0) as learner:
        learner.snapshot_reference()
        held = probe(learner, reference_numel)
        # a half each, padded per tensor: sharded, and not left empty
        assert all(h["full"] / 2 <= h["held"] <= h["full"] / 2 + 1024 for h in held), held
        policy = probe(learner, state_copy)[0]
        assert _same(probe(learner, reference_state)[0], policy)
        learner.save_checkpoint(str(tmp_path))
        learner.load_checkpoint(str(tmp_path))
        assert probe(learner, reference_numel) == held
        assert _same(probe(learner, reference_state)[1], policy)
        saved = dict(state_files.StateFiles(str(tmp_path / "reference")))
        assert sum(v.numel() for v in saved.values()) >= held[0]["full"]  # saved whole
        assert _same(saved, policy)


@pytest.mark.parametrize("persistence", [0, 10**5])
def test_zero3_reference_copied_shard_to_shard_is_the_policy_after_steps(learners, system_cfg, batch, persistence):
    """After optimizer steps (the partitions written back by ZeRO-3's optimizer) and with small
    parameters kept whole on every rank (DeepSpeed's default persistence threshold), the
    reference snapshot holds the policy's current weights exactly."""
    learner_cfg = replace(system_cfg.learner, num_ranks=2, zero_stage=3, num_cpus_per_rank=0.1,
                          deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": persistence}})
    with learners.learner(system_cfg.model.path, learner_cfg, system_cfg.algo, system_cfg.rollout.max_new_tokens,
                          0) as learner:
        learner.snapshot_reference()
        learner.train_step([ray.put(g) for g in batch], 1.0, 1e-2)
        learner.snapshot_reference()
        policy = probe(learner, state_copy)[0]
        assert not _same(policy, _initial_weights(system_cfg.model.path)), "the step changed nothing"
        for state in probe(learner, reference_state):
            assert _same(state, policy)


def _initial_weights(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


OFFLOAD = {"deepspeed": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}
CPU_ADAM_BUILD_S = 600  # a first JIT build of DeepSpeed's CPU Adam on 2 busy cores; then it loads in seconds


def _build_cpu_adam() -> None:
    """DeepSpeed's CPU Adam op built (or loaded) in a process of its own, bounded: its JIT build
    waits on a lock file, and one left by a killed build would hang the learner's start for good."""
    import subprocess
    import sys

    script = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
              "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()")
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CPU_ADAM_BUILD_S)
    except subprocess.TimeoutExpired:
        from torch.utils.cpp_extension import _get_build_directory

        pytest.fail(f"DeepSpeed's CPU Adam op did not build within {CPU_ADAM_BUILD_S}s; a stale lock file in "
                    f"{_get_build_directory('cpu_adam', verbose=False)} would explain it")
    assert proc.returncode == 0, proc.stderr[-2000:]


def _second_adam_step_tolerance(gradient: dict) -> dict:
    """Per-element bound on how far AdamW's second step (per unit of lr) may differ between two
    runs whose gradients differ by at most dg = GRAD_RTOL * max|g|. With bias correction the
    step is m/(sqrt(v) + eps), m = (0.09 g1 + 0.1 g2) / 0.19 and v = (0.000999 g1^2 + 0.001 g2^2)
    / 0.001999, so sqrt(v) >= 0.7 |g1|; a change dg of g2 moves m by 0.53 dg and sqrt(v) by at
    most 0.71 dg, hence the step by at most about 2.3 dg / |g1| (4 dg / |g1| allowed), where g1
    is sure of its sign (|g1| >= 10 dg, as in `_adam_tolerance`); elsewhere only |step| <= 1
    holds, so two runs differ by at most 2. Unlike the first step's, this bound is not squeezed
    by eps: the second step weighs g2 against g1."""
    dg = GRAD_RTOL * max(float(g.abs().max()) for g in gradient.values())
    out = {}
    for k, g in gradient.items():
        a = g.abs().double()
        out[k] = torch.where(a >= 10 * dg, (4 * dg / a.clamp(min=1e-30)).clamp(max=2.0), torch.full_like(a, 2.0))
    return out


def _two_steps(learners, cfg, groups, learner_settings=None):
    """Two AdamW steps of one ZeRO-2 rank on the same batch (one minibatch each); returns the
    update per unit of lr, each step's metrics and the weights before."""
    learner_cfg = replace(cfg.learner, num_ranks=1, zero_stage=2, minibatches=1, num_cpus_per_rank=0.1,
                          max_tokens_per_microbatch=0, optimizer="adamw", **(learner_settings or {}))
    with learners.learner(cfg.model.path, learner_cfg, cfg.algo, cfg.rollout.max_new_tokens, cfg.trainer.seed) as learner:
        learner.snapshot_reference()
        before = probe(learner, state_copy)[0]
        metrics = [learner.train_step([ray.put(g) for g in groups], 1.0, ADAM_LR) for _ in range(2)]
        after = probe(learner, state_copy)[0]
    return {k: (before[k] - after[k]) / ADAM_LR for k in before}, metrics, before


def test_zero_offload_trains_two_steps_like_zero2(learners, system_cfg, batch, reference):
    """ZeRO-Offload (the optimizer on the host: DeepSpeed's CPU Adam) against ZeRO-2 with torch's
    AdamW, two steps on the same batch. The runs compute their gradients the same way; the
    optimizers differ only in their fp32 arithmetic. The first steps see `reference`'s gradient
    and agree within `_adam_tolerance`; the second steps within `_second_adam_step_tolerance`."""
    _build_cpu_adam()
    gradient, _, _ = reference
    plain, plain_metrics, weights = _two_steps(learners, system_cfg, batch)
    offload, metrics, _ = _two_steps(learners, system_cfg, batch, OFFLOAD)
    first, second = _adam_tolerance(gradient, weights), _second_adam_step_tolerance(gradient)
    for k in plain:
        diff = (plain[k] - offload[k]).abs().double()
        bound = first[k] + second[k]
        assert (diff <= bound).all(), f"{k}: two steps differ by {float((diff - bound).max()):.2e} over the bound"
    assert any(float(u.abs().max()) > 0.5 for u in offload.values()), "the offloaded steps moved the weights"
    assert metrics[0]["loss"] == plain_metrics[0]["loss"]  # the same weights, batch and computation


def test_a_rank_starts_without_importing_mlflow_and_can_still_import_it(learners, system_cfg):
    """DeepSpeed's autotuner imports MLflow at DeepSpeed's import when it is installed (the
    `mlflow` logger's extra): a rank goes without it (learner/engines.py import_deepspeed), as
    its start need not pay for a package it never uses, and a later `import mlflow` still works."""
    def mlflow_imports(_rank) -> tuple:
        import sys

        before = "mlflow" in sys.modules
        import mlflow

        return before, mlflow.__name__

    with learners.learner(system_cfg.model.path, replace(system_cfg.learner, num_ranks=1), system_cfg.algo,
                          system_cfg.rollout.max_new_tokens, 0) as learner:
        assert probe(learner, mlflow_imports) == [(False, "mlflow")]
