"""LoRA for real (peft, DeepSpeed, vLLM's CPU build): the learner's step is the adapters'
gradient of the GRPO loss computed by hand with peft on the same batch, with the reference
the base with its adapters off; only the adapters have optimizer state; the adapter push leaves
an engine that equals a fresh engine of the base given the saved adapter."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from cluster.loop.sync_channel import WeightSyncChannel
from common import state_files
from common.config import LoraConfig
from learner_pool import probe, state_copy, trained_numel
from helpers import engine_state, serve_adapter, varied_groups, warmed_learner
from learner import engines, grpo
from rollout.pool import RolloutPool

G = 4
RANK = 4
GRAD_RTOL = 1e-4  # as the equivalence test's: reduction-order rounding only
# DeepSpeed keeps parameters under 1e5 elements whole by default: every one of the tiny model's.
EVERY_PARAMETER_PARTITIONED = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _lora_cfg(cfg, **learner):
    lora = LoraConfig(rank=RANK, alpha=8.0)
    return replace(cfg, learner=replace(cfg.learner, lora=lora, **learner))


class PlainLoRA:
    """The GRPO loss of a peft model in plain PyTorch: pi_old the policy before the step,
    pi_ref the base (adapters off), SGD steps of the clipped adapter gradient."""

    def __init__(self, model_path: str, state: dict, groups, cfg):
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = get_peft_model(base, engines.lora_config(cfg.learner.lora))
        self.model.load_state_dict(state)
        self.clip, self.algo = cfg.learner.grad_clip, cfg.algo
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
        self.A = grpo.compute_advantages(torch.tensor([r for g in groups for r in g.rewards]), G, scale="group",
                                         eps=1e-4)

    def logprobs(self) -> torch.Tensor:
        logits = self.model(input_ids=self.ids, attention_mask=self.attention).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, self.ids[:, 1:, None]).squeeze(-1)

    def sgd_step(self, lr: float) -> dict:
        """One step; returns the change of each adapter per unit of lr."""
        with torch.no_grad():
            old = self.logprobs()
            with self.model.disable_adapter():
                ref = self.logprobs()
        a = self.algo
        loss, _ = grpo.policy_loss(self.logprobs(), old, ref, self.A, self.mask, clip_low=a.clip_low,
                                   clip_high=a.clip_high, beta=a.beta, kl_estimator=a.kl_estimator,
                                   loss_agg=a.loss_agg)
        trained = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
        self.model.zero_grad()
        loss.backward()
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained.values())))
        scale = min(1.0, self.clip / (norm + 1e-6))
        with torch.no_grad():
            for p in trained.values():
                p -= lr * scale * p.grad
        return {k: scale * p.grad.detach().clone() for k, p in trained.items()}


def _adapters(state: dict) -> dict:
    return {k: v for k, v in state.items() if engines.LORA_MARK in k}


def _mismatch(update: dict, reference: dict) -> float:
    assert update.keys() == reference.keys()
    scale = max(float(v.abs().max()) for v in reference.values())
    assert scale > 0, "the reference step changed nothing"
    return max(float((update[k] - reference[k]).abs().max()) for k in reference) / scale


@pytest.mark.parametrize("num_ranks,zero_stage,from_start", [(1, 2, False), (2, 3, False), (2, 3, True)])
def test_lora_steps_are_the_adapter_gradient_by_hand(learners, system_cfg, num_ranks, zero_stage, from_start):
    """Two SGD steps (lr 1: the update is the clipped gradient): at the first the policy equals
    the reference (B = 0), at the second the KL to the adapters-off base pulls too. One ZeRO-2
    rank, and two ZeRO-3 ranks with every parameter partitioned, adapters included: both within
    reduction-order rounding of the same hand computation, so of each other. `from_start`: a
    run without warm-up, whose ranks build the adapters' engine on the loaded model and never
    the whole model's (no optimizer state for it at any point)."""
    cfg = _lora_cfg(system_cfg, num_ranks=num_ranks, zero_stage=zero_stage, optimizer="sgd", minibatches=1,
                    max_tokens_per_microbatch=0, num_cpus_per_rank=0.1, deepspeed=EVERY_PARAMETER_PARTITIONED)
    cfg = replace(cfg, algo=replace(cfg.algo, beta=0.5))  # a KL term large enough to tell
    vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
    groups = varied_groups(vocab, G)
    with learners.learner(cfg.model.path, cfg.learner, cfg.algo, cfg.rollout.max_new_tokens, 0,
                          from_start) as learner:
        if from_start:
            assert all(probe(learner, lambda rank: rank.policy.lora)), "the ranks built the whole model's engine"
        learner.snapshot_reference()
        numel = probe(learner, trained_numel)
        states = [probe(learner, state_copy)[0]]
        for _ in range(2):
            learner.train_step([ray.put(g) for g in groups], 1.0, 1.0)
            states.append(probe(learner, state_copy)[0])
    # Only the adapters train and the optimizer holds nothing else: 2 r (d_in + d_out) each.
    dims = json.loads((Path(cfg.model.path) / "config.json").read_text())
    h, m, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    kv = h // dims["num_attention_heads"] * dims.get("num_key_value_heads", dims["num_attention_heads"])
    per_layer = RANK * ((h + h) * 2 + (h + kv) * 2 + 2 * (h + m) + (m + h))
    # Under ZeRO-3 each rank's optimizer holds its partition of each adapter (padded to the ranks).
    held = sum(n["optimizer_params"] for n in numel)
    assert numel[0]["trainable"] == layers * per_layer <= held < layers * per_layer + 14 * layers * num_ranks, numel
    assert numel[0]["all"] > 10 * numel[0]["trainable"]
    plain = PlainLoRA(cfg.model.path, states[0], groups, cfg)
    for step in range(2):
        by_hand = plain.sgd_step(1.0)
        update = {k: states[step][k] - states[step + 1][k] for k in _adapters(states[0])}
        error = _mismatch(update, by_hand)
        assert error <= GRAD_RTOL, f"step {step + 1}: adapter gradients differ by {error:.2e}"
    base = {k: v for k, v in states[0].items() if engines.LORA_MARK not in k}
    assert all(torch.equal(base[k], states[-1][k]) for k in base), "the base changed"


@pytest.fixture(scope="module")
def lora_engine(ray_session, system_cfg):
    """One engine that serves adapters, for every stage's push (each push sends its base first)."""
    rollout = replace(system_cfg.rollout, num_workers=1, num_cpus_per_worker=0.5, max_lora_rank=8)
    pool = RolloutPool(system_cfg.model.path, rollout, 0)
    yield rollout, pool
    pool.shutdown()


def test_adapters_from_the_start_push_no_base_and_serve_on_the_initial_weights(learners, fresh_engines, lora_engine,
                                                                              system_cfg, tmp_path):
    """A run without warm-up: the base is what the engines loaded, so no push ever sends it
    (it went whole through a shared file, and ran a 1.6 B model out of memory), and the engine
    after the adapters' push equals a fresh engine of the model with the saved adapter. First
    of the module's pushes: its engine still holds the initial weights, as a run's do."""
    cfg = _lora_cfg(system_cfg, num_ranks=2, zero_stage=3, num_cpus_per_rank=0.1,
                    deepspeed=EVERY_PARAMETER_PARTITIONED)
    rollout, pool = lora_engine
    with learners.learner(cfg.model.path, cfg.learner, cfg.algo, cfg.rollout.max_new_tokens, 0, True) as learner:
        learner.snapshot_reference()
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=0.25, timeout_s=120)
        assert channel.base_spec is None
        vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
        learner.train_step([ray.put(g) for g in varied_groups(vocab, G)], 1.0, 1e-2)
        metrics = channel.push(1)
        adapter = learner.save_pretrained(str(tmp_path / "adapter"), "adapter")
    assert pool.versions() == [1]
    assert 0 < metrics["sync_bytes"] < sum(p.stat().st_size for p in Path(cfg.model.path).glob("*.safetensors")) / 10
    fresh = fresh_engines.engine(cfg.model.path, rollout, 123)
    ray.get(fresh.__ray_call__.remote(serve_adapter, adapter))
    assert engine_state(pool.workers[0]) == engine_state(fresh), "the engine differs from the model + saved adapter"


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_adapter_push_equals_a_fresh_engine_with_the_saved_adapter(learners, fresh_engines, lora_engine, system_cfg,
                                                                   zero_stage, tmp_path):
    """Under ZeRO-3 (every parameter partitioned by warmed_learner) the push gathers the base and
    then the adapters bucket by bucket, and the saved base and adapter are gathered too."""
    cfg = _lora_cfg(system_cfg)
    rollout, pool = lora_engine
    with warmed_learner(learners, cfg, zero_stage) as learner:  # a base other than the engines' initial weights
        learner.snapshot_reference()
        channel = WeightSyncChannel(learner, pool, cfg.rollout.dtype, bucket_mb=0.25, timeout_s=120)
        vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
        learner.train_step([ray.put(g) for g in varied_groups(vocab, G)], 1.0, 1e-2)
        metrics = channel.push(zero_stage)  # the base, then the adapters
        base_bytes = sum(4 * torch.Size(s).numel() for _, s in channel.base_spec["tensors"])
        assert pool.versions() == [zero_stage]
        base = learner.save_pretrained(str(tmp_path / "base"), "base")
        adapter = learner.save_pretrained(str(tmp_path / "adapter"), "adapter")
    fresh = fresh_engines.engine(base, rollout, 123)
    ray.get(fresh.__ray_call__.remote(serve_adapter, adapter))
    expected, got = engine_state(fresh), engine_state(pool.workers[0])
    assert got[0] == expected[0], "greedy outputs differ from a fresh engine's with the saved adapter"
    assert got[1] == expected[1], "prompt log-probs differ from a fresh engine's with the saved adapter"
    assert got[2] == expected[2], "base parameters differ from a fresh engine's"
    if zero_stage == 2:  # once is enough: an engine start costs ~20 s
        plain = fresh_engines.engine(base, replace(rollout, max_lora_rank=0), 123)
        assert engine_state(plain)[1] != got[1], "the adapter changed nothing"
    assert 0 < metrics["sync_bytes"] < base_bytes / 10, (metrics["sync_bytes"], base_bytes)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_resume_is_bit_exact(learners, system_cfg, zero_stage, tmp_path):
    """A LoRA learner checkpointed after a step and restored in a fresh build takes the next
    AdamW step to the same bits as the run that went on; the checkpoint holds the base once,
    the adapters, and DeepSpeed's state of the adapters alone; `grpo export` gives the saved
    adapters and their merge into the saved base. Under ZeRO-3 every parameter is partitioned:
    the base and adapters are gathered to save them and the base read back partition by
    partition."""
    from cluster.loop.checkpoint import STATE_FILE, export_checkpoint

    cfg = _lora_cfg(system_cfg, num_ranks=2, zero_stage=zero_stage, num_cpus_per_rank=0.1,
                    deepspeed=EVERY_PARAMETER_PARTITIONED)
    vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
    refs = [ray.put(g) for g in varied_groups(vocab, G)]
    settings = (cfg.model.path, cfg.learner, cfg.algo, cfg.rollout.max_new_tokens, 0)
    checkpoint = tmp_path / "checkpoint"
    with learners.learner(*settings) as learner:
        learner.snapshot_reference()
        learner.train_step(refs, 1.0, 1e-2)
        learner.save_checkpoint(str(checkpoint))
        saved = probe(learner, state_copy)[0]
        learner.train_step(refs, 1.0, 1e-2)
        went_on = probe(learner, state_copy)[0]
    with learners.learner(*settings) as learner:  # rebuilt: the full model again, as a new run starts
        learner.load_checkpoint(str(checkpoint))
        learner.train_step(refs, 1.0, 1e-2)
        resumed = probe(learner, state_copy)[0]
    assert went_on.keys() == resumed.keys()
    assert all(torch.equal(went_on[k], resumed[k]) for k in went_on), "the resumed step differs"
    assert state_files.exists(str(checkpoint / "base")) and (checkpoint / "adapter" / "adapter_config.json").is_file()
    assert not (checkpoint / "reference").exists()
    # Adapters only (under ZeRO-3 one file per rank): no frozen tensor, not even the tied output
    # head (an alias of the embedding).
    files = sorted((checkpoint / "learner" / "ds").glob("*mp_rank_00_model_states.pt"))
    assert len(files) == (2 if zero_stage == 3 else 1), files
    for file in files:
        module = torch.load(file, weights_only=False)["module"]
        assert any(engines.LORA_MARK in k for k in module), sorted(module)
        assert all(engines.LORA_MARK in k for k in module), sorted(k for k in module if engines.LORA_MARK not in k)
    (checkpoint / STATE_FILE).write_text("{}")  # the driver's part of a checkpoint: export only checks it is there
    _assert_exports_the_saved_policy(export_checkpoint, checkpoint, tmp_path, saved)


def _assert_exports_the_saved_policy(export_checkpoint, checkpoint: Path, tmp_path: Path, saved: dict) -> None:
    """The exported adapter folder holds the adapters as they were saved; the merged export is
    the saved base with W + (alpha / r) B A in each adapted weight, the same fp32 operations."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import load_file

    base, adapters = engines.split_state(saved)
    exported = load_file(Path(export_checkpoint(str(checkpoint), str(tmp_path / "adapter"))) / "adapter_model.safetensors")
    assert exported.keys() == adapters.keys()
    assert all(torch.equal(exported[k], adapters[k]) for k in adapters), "the exported adapters differ"
    config = PeftLoraConfig.from_pretrained(str(checkpoint / "adapter"))
    expected = engines.merged_state(base, engines.adapters_by_weight(saved, config))
    merged = load_file(Path(export_checkpoint(str(checkpoint), str(tmp_path / "merged"), merged=True))
                       / "model.safetensors")
    missing = expected.keys() - merged.keys()
    assert missing <= {"lm_head.weight"} and merged.keys() <= expected.keys(), (missing, merged.keys() - expected.keys())
    assert all(torch.equal(merged[k], expected[k]) for k in merged), \
        [k for k in merged if not torch.equal(merged[k], expected[k])]
