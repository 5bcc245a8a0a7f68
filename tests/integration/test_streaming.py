"""Streaming generation and partial rollouts on the real stack (the session's engines, learner
and verifiers): a sample that spans a real weight push, and a few streaming GRPO steps."""
from __future__ import annotations

import copy

import ray
import torch

from cluster.loop.batches import generation_requests
from cluster.loop.buffer import RolloutBuffer
from cluster.loop.phases import grpo_step
from cluster.loop.streaming import StreamingBatches
from data.datasets import PromptSampler, load_problems

FIRST_CALL_STEPS = 4


def _advance(worker, requests, tickets, n, max_steps):
    """One streaming call: (the finished groups, its StreamReport)."""
    refs = list(worker.advance.options(num_returns="streaming").remote(
        *requests, tickets=tickets, n=n, max_steps=max_steps, return_after=len(tickets) or 1))
    values = ray.get(refs)
    return values[:-1], values[-1], refs[:-1]


def _hf_logprobs(folder, group):
    """Per completion, log pi(token) of each sampled token under the model saved in `folder`
    (float32, temperature 1: what the engine's processed log-probs are at rollout.temperature=1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in group.completion_ids:
            tokens = torch.tensor([group.prompt_ids + ids])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].float(), -1)
            start = len(group.prompt_ids) - 1
            out.append(logp[start:start + len(ids)].gather(-1, torch.tensor(ids)[:, None])[:, 0])
    return out


def test_a_sample_spanning_a_push_records_both_versions_and_trains_on_each_token_s_own_log_prob(
        roles, system_cfg, tmp_path):
    """Two requests stepped FIRST_CALL_STEPS tokens, a real push of changed weights, then run to
    their end in the same engine (rollout.partial's path: KV cache kept). Each completion carries
    two spans; tokens of the first span are the old weights' samples (their log-probs match a
    float32 transformers model of the old weights), the second span's are closer to the new
    weights'; and the learner's sampler/trainer gap over them is the one computed from each
    token's own recorded log-prob."""
    assert system_cfg.rollout.temperature == 1.0
    worker, n = roles.rollout.workers[0], 2
    version = roles.channel.version
    old = roles.learner.save_pretrained(str(tmp_path / "old"))
    train = load_problems(system_cfg.data, system_cfg.trainer.seed).train
    requests = generation_requests([(i, train[i]) for i in range(2)], 11)
    groups, report, refs = _advance(worker, requests, [0, 1], n, FIRST_CALL_STEPS)
    assert not groups and report.running == 2, "the requests must still run after the first call"

    # Changed weights (two supervised steps at a high rate), pushed while the requests run.
    examples = [(p.warmup_prompt or p.prompt, p.solution) for p in train[:64] if p.solution]
    roles.learner.load_warmup(ray.put(examples))
    roles.learner.warmup(2, 16, 1e-2, 5)
    roles.channel.push(version + 1)
    new = roles.learner.save_pretrained(str(tmp_path / "new"))

    found, refs = [], []
    for _ in range(100):
        groups, report, got = _advance(worker, [], [], n, 16)
        found += groups
        refs += got
        if len(found) == 2:
            break
    assert [g.index for g in sorted(found, key=lambda g: g.index)] == [0, 1]
    old_gap, new_gap = {0: [], 1: []}, {0: [], 1: []}
    for group in found:
        assert group.policy_version == version  # the oldest span
        old_lp, new_lp = _hf_logprobs(old, group), _hf_logprobs(new, group)
        for spans, sampled, o, w in zip(group.version_spans, group.sampler_logprobs, old_lp, new_lp):
            assert spans == [(version, 0, FIRST_CALL_STEPS), (version + 1, FIRST_CALL_STEPS, len(sampled))]
            sampled = torch.tensor(sampled)
            for span, (_, start, end) in enumerate(spans):
                old_gap[span] += (sampled[start:end] - o[start:end]).abs().tolist()
                new_gap[span] += (sampled[start:end] - w[start:end]).abs().tolist()

    def mean(values):
        return sum(values) / len(values)

    # The old weights' tokens: the same float32 model in two implementations (a few 1e-5).
    assert mean(old_gap[0]) < 1e-3 < mean(new_gap[0]), (mean(old_gap[0]), mean(new_gap[0]))
    # The new weights' tokens attend to keys and values the old weights computed: nearer the
    # new model than the old one, not equal to it (the mismatch partial rollouts bring).
    assert mean(new_gap[1]) < mean(old_gap[1]), (mean(new_gap[1]), mean(old_gap[1]))
    print(f"partial rollouts, KV kept: mean |sampler - new policy| log-prob gap after the push "
          f"{mean(new_gap[1]):.4f} (old policy {mean(old_gap[1]):.4f}; before the push {mean(old_gap[0]):.2e})")

    # The learner weights each token by its own sampler log-prob: its reported gap is the mean
    # over every token of |sampler - pi_old| with pi_old the new weights (learning rate 0: no update).
    scored, _ = roles.verifiers.score([ray.put(g) for g in sorted(found, key=lambda g: g.index)])
    metrics = roles.learner.train_step(scored, system_cfg.rollout.temperature, 0.0)
    expected = mean(new_gap[0] + new_gap[1])
    assert abs(metrics["sampler_logprob_gap"] - expected) < 1e-3, (metrics["sampler_logprob_gap"], expected)


def test_streaming_partial_steps_train_every_issued_prompt_once(roles, system_cfg):
    """Three GRPO steps from a streaming source with partial rollouts: each step is its issued
    prompts, in order, once; groups carry spans; pushes reached running requests."""
    cfg = copy.deepcopy(system_cfg)
    cfg.trainer.mode, cfg.trainer.async_lookahead, cfg.algo.max_staleness = "async", 2, 2
    cfg.rollout.streaming = cfg.rollout.partial = True
    train = load_problems(cfg.data, cfg.trainer.seed).train
    roles.learner.snapshot_reference()
    version = roles.channel.version
    batches = StreamingBatches(roles, PromptSampler(train, 4), cfg, 1, 3, cfg.trainer.async_lookahead)
    buffer, rows, seen = RolloutBuffer(), [], []
    try:
        for step in (1, 2, 3):
            record = grpo_step(step, version, roles, batches, buffer, cfg)
            version = record.policy_version
            rows.append(record.metrics)
            seen += [(s["prompt"], s["sample"]) for s in record.samples]
    finally:
        batches.close()
    assert len(seen) == len(set(seen)) == 3 * cfg.trainer.prompts_per_step * cfg.algo.group_size
    for row in rows:
        assert 0 < row.get("slot_occupancy", 1) <= 1 and row["completion_len_trained_mean"] > 0
        assert row["staleness_max"] <= cfg.algo.max_staleness
    assert sum(r["engine_steps"] for r in rows) > 0 and any("completion_len_sampled_mean" in r for r in rows)
    assert roles.rollout.versions() == [version, version]


def test_streaming_partial_rollouts_learn_the_built_in_task(initial_roles, warmed, system_cfg):
    """The async learning test's job (the default job's warm-up and batch, 20 steps) from the
    streaming source with partial rollouts, two steps issued ahead: held-out greedy accuracy on
    400 problems must rise by more than its sampling noise (`learned`)."""
    from cluster.loop.roles import evaluate
    from common.config import WarmupConfig
    from helpers import learned

    cfg = copy.deepcopy(system_cfg)
    cfg.trainer.mode, cfg.trainer.max_steps, cfg.trainer.prompts_per_step = "async", 20, 64
    cfg.trainer.async_lookahead, cfg.algo.max_staleness = 2, 2
    cfg.rollout.streaming = cfg.rollout.partial = True
    cfg.algo.group_size, cfg.data.heldout_size = 8, 400
    cfg.warmup = WarmupConfig()
    roles = initial_roles
    heldout, train = load_problems(cfg.data, cfg.trainer.seed)
    version = warmed(cfg, train)
    before = evaluate(roles, heldout)
    batches = StreamingBatches(roles, PromptSampler(train, 0), cfg, 1, cfg.trainer.max_steps, 2)
    buffer, rows = RolloutBuffer(), []
    try:
        for step in range(1, cfg.trainer.max_steps + 1):
            record = grpo_step(step, version, roles, batches, buffer, cfg)
            version = record.policy_version
            rows.append(record.metrics)
    finally:
        batches.close()
    after = evaluate(roles, heldout)
    assert max(r["staleness_max"] for r in rows) <= 2
    assert learned(before, after, len(heldout)), f"streaming + partial GRPO: held-out {before:.1%} -> {after:.1%}"
