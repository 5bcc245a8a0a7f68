"""One DeepSpeed ZeRO data-parallel rank of the policy learner, as a Ray actor.

Every rank holds the policy under DeepSpeed (gloo on CPU, NCCL on GPU) and, when beta > 0, a
frozen reference copy. Rank 0 is also the sender of the weight-sync channel.
"""
from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Dict, List, Optional

import torch

from cluster import weight_sync
from cluster.ray_utils import free_port, node_ip
from learner import grpo, ppo
from learner.logprobs import token_logprobs


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`, recursively for nested dicts (DeepSpeed settings from the config)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class LearnerRank:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, learner_cfg: dict, algo_cfg: dict, seed: int):
        # Ray sets none of torch.distributed's variables; DeepSpeed reads them from the env.
        os.environ.update({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
        })
        self.on_gpu = torch.cuda.is_available() and learner_cfg["num_gpus_per_rank"] > 0
        if not self.on_gpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
            torch.set_num_threads(1)  # ranks share the machine's cores with the rollout engines
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not self.on_gpu:
            # DeepSpeed's CPU backend JIT-loads a shared-memory all-reduce op at start-up, used
            # only by inference_all_reduce, never in training. Loading it waits on a lock file
            # that a rank killed while loading leaves behind (a stopped job, a Ctrl-C): every
            # later learner on the machine then hangs in __init__. Training needs none of it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = learner_cfg["backend"]
        if backend == "auto":
            backend = "nccl" if self.on_gpu else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        torch.manual_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.algo = learner_cfg, algo_cfg
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Llama-style tokenizers have no pad token: any id works under the attention mask.
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.warmup_examples: List[tuple] = []
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        ds_config = deep_merge({
            "train_micro_batch_size_per_gpu": 1,  # batches are formed here, not by DeepSpeed
            "gradient_accumulation_steps": 1,
            "gradient_clipping": learner_cfg["grad_clip"],
            "zero_optimization": {"stage": learner_cfg["zero_stage"]},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.on_gpu},
            "steps_per_print": 10**9,
        }, learner_cfg.get("deepspeed") or {})
        self.ds_config = ds_config
        optim_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[learner_cfg["optimizer"]]
        optimizer = optim_class(model.parameters(), lr=learner_cfg["lr"], weight_decay=learner_cfg["weight_decay"])
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config)
        self.device = self.engine.device
        self.critic = None
        if algo_cfg["adv_estimator"] == "gae":
            # PPO's value model: the policy's architecture with a scalar head per token, its own
            # DeepSpeed engine and optimizer (what GRPO does without).
            from transformers import AutoModelForTokenClassification

            critic = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=self.dtype)
            critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=algo_cfg["critic_lr"],
                                                 weight_decay=learner_cfg["weight_decay"])
            self.critic, _, _, _ = deepspeed.initialize(model=critic, optimizer=critic_optimizer, config=ds_config)
        self.ref_model = None
        self.sync_group = None

    # ---- helpers -------------------------------------------------------------------------
    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _full_state(self):
        """The full (unsharded) parameters; under ZeRO-3 gathered on every rank for the duration."""
        import deepspeed  # imported after DS_ACCELERATOR is set, in __init__

        params = list(self.engine.module.parameters())
        if self.cfg["zero_stage"] == 3:
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return contextlib.nullcontext()

    def _token_logprobs(self, model, input_ids, attention_mask, temperature: float = 1.0,
                        entropy: bool = False):
        """log pi(token_t | tokens_<t) for t = 1..T-1, shape [N, T-1]; with `entropy`, also the
        policy's entropy at each of those positions (no gradient), as a pair. Never a full
        float32 log-softmax: see learner/logprobs.py."""
        return token_logprobs(model, input_ids, attention_mask, temperature, with_entropy=entropy)

    @torch.no_grad()
    def _fixed_logprobs(self, model, ids, attention, temperature: float):
        """Log-probs [N, T-1] of a model that does not change during the step (pi_old, pi_ref),
        in the same micro-batches as the update, so a forward's memory is bounded by the
        token budget, not the batch."""
        out = torch.zeros((ids.shape[0], ids.shape[1] - 1), dtype=torch.float32, device=self.device)
        for micro in self._micro_batches(torch.arange(ids.shape[0], device=self.device), attention):
            T = int(attention[micro].sum(dim=1).max())
            out[micro, :T - 1] = self._token_logprobs(model, ids[micro, :T], attention[micro, :T], temperature)
        return out

    def _pad(self, sequences: List[List[int]], completion_starts: List[int]):
        """Right-padded ids, attention mask, and the mask of completion tokens (as targets)."""
        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), length), dtype=torch.long)
        target_mask = torch.zeros((len(sequences), length - 1), dtype=torch.bool)
        for i, (seq, start) in enumerate(zip(sequences, completion_starts)):
            assert start >= 1, "a completion needs at least one prompt token before it"
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            target_mask[i, start - 1: len(seq) - 1] = True  # targets are shifted by one
        return ids.to(self.device), attention.to(self.device), target_mask.to(self.device)

    # ---- supervised warm-up --------------------------------------------------------------
    def load_warmup(self, examples: List[List[str]], end_ids: Optional[List[int]] = None) -> int:
        """Tokenise the (prompt, target) pairs once; the warm-up then runs in chunks. Each target
        ends with `end_ids` (a chat format's end-of-turn token), by default the tokenizer's EOS."""
        if end_ids is None:
            end_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.warmup_examples = [
            (self.tokenizer(p)["input_ids"], self.tokenizer(t, add_special_tokens=False)["input_ids"] + list(end_ids))
            for p, t in examples
        ]
        return len(self.warmup_examples)

    def warmup(self, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        """Supervised steps on the loaded pairs; loss on target tokens only.

        Every rank draws the same global batch from the same seed and trains on its slice, so
        all ranks take the same number of steps (each step is a collective).
        """
        self._set_lr(lr)
        rng = random.Random(seed)
        per_rank = batch_size // self.world_size
        encoded = self.warmup_examples
        losses = []
        self.engine.train()
        for _ in range(steps):
            batch = rng.sample(range(len(encoded)), batch_size)[self.rank * per_rank:(self.rank + 1) * per_rank]
            seqs = [encoded[i][0] + encoded[i][1] for i in batch]
            starts = [len(encoded[i][0]) for i in batch]
            ids, attention, mask = self._pad(seqs, starts)
            logprobs = self._token_logprobs(self.engine, ids, attention)
            loss = -(logprobs * mask).sum() / mask.sum()
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss.detach()))
        return losses  # train_step sets the GRPO lr of each step itself

    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as pi_ref (GRPO starts from the warmed-up model)."""
        if self.algo["beta"] <= 0:
            return  # beta = 0 needs no reference model at all
        with self._full_state():
            state = {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        self.ref_model = self._frozen_reference(state)

    def _frozen_reference(self, state: dict):
        """pi_ref from a full state dict. Under ZeRO-3 it is partitioned like the policy (a
        DeepSpeed engine with no optimizer, each rank holding its shard, gathered layer by layer
        in its forward): a full copy per rank is what ZeRO-3 is there to avoid."""
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_config(self.engine.module.config, dtype=self.dtype)
        ref.load_state_dict(state, strict=True)
        ref = ref.to(self.device).eval().requires_grad_(False)
        if self.cfg["zero_stage"] != 3:
            return ref
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "bf16": {"enabled": self.on_gpu},
                  "zero_optimization": dict(self.ds_config["zero_optimization"])}
        engine, _, _, _ = deepspeed.initialize(model=ref, config=config)
        engine.eval()  # DeepSpeed's eval() returns None, not the engine
        return engine

    def reference_numel(self) -> Dict[str, int]:
        """Elements of pi_ref this rank holds, and the full model's (for tests)."""
        module = getattr(self.ref_model, "module", self.ref_model)
        params = list(module.parameters())
        return {"held": sum(p.numel() for p in params), "full": sum(getattr(p, "ds_numel", p.numel()) for p in params)}

    def _reference_state(self) -> dict:
        """The full reference weights (a collective under ZeRO-3: every rank calls it)."""
        module = getattr(self.ref_model, "module", self.ref_model)
        if self.cfg["zero_stage"] != 3:
            return module.state_dict()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    # ---- GRPO ----------------------------------------------------------------------------
    def train_step(self, group_refs: list, temperature: float, lr: float) -> Dict[str, float]:
        """One GRPO update on this rank's prompt groups (fetched by reference from the object
        store); returns this rank's metrics."""
        import ray

        return self.train_on(ray.get(list(group_refs)), temperature, lr)

    def train_on(self, groups: list, temperature: float, lr: float) -> Dict[str, float]:
        """One GRPO update on these prompt groups. Needs no Ray: the rank works in a plain
        process too (the GPU check runs it so)."""
        start = time.perf_counter()
        self._set_lr(lr)
        G = groups[0].group_size
        seqs, starts, rewards, lengths, truncated, sampled = [], [], [], [], [], []
        for g in groups:
            behaviour = getattr(g, "sampler_logprobs", None) or [None] * g.group_size
            for ids, reason, reward, lps in zip(g.completion_ids, g.finish_reasons, g.rewards, behaviour):
                seqs.append(list(g.prompt_ids) + list(ids))
                starts.append(len(g.prompt_ids))
                rewards.append(reward)
                lengths.append(len(ids))
                truncated.append(reason == "length")
                sampled.append(lps)
        ids, attention, mask = self._pad(seqs, starts)
        sampler_logprobs = self._sampler_logprobs(sampled, starts, mask)
        r = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        shaping = torch.zeros_like(r)
        if self.algo["overlong_buffer"] > 0:  # DAPO: a soft penalty before the length limit
            shaping = grpo.overlong_penalty(torch.tensor(lengths, device=self.device), self.algo["max_length"],
                                            self.algo["overlong_buffer"], self.algo["overlong_penalty"])
            r = r + shaping
        if self.algo["mask_truncated"]:  # DAPO: a cut-off answer teaches nothing about its end
            cut = torch.tensor(truncated, dtype=torch.bool, device=self.device)
            mask = mask & ~cut[:, None]
        scale, eps = self.algo["adv_scale"], self.algo["adv_eps"]
        ppo_mode = self.critic is not None
        if not ppo_mode:
            # "batch" means the whole step's batch, across ranks, not this rank's share of it.
            A = grpo.compute_advantages(r, G, scale="none" if scale == "batch" else scale, eps=eps,
                                        estimator=self.algo["adv_estimator"])
            if scale == "batch":
                A = A / (self._global_std(r) + eps)

        # pi_old and pi_ref are fixed for the whole step: computed once, before any update.
        num_mb = self.cfg["minibatches"]
        single_update = self.algo["num_iterations"] == 1 and num_mb == 1
        use_is = self.algo["is_cap"] > 0 and sampler_logprobs is not None
        with torch.no_grad():
            # With one update per batch, pi_old is the policy being differentiated: its
            # log-probs are the same numbers, detached (saves a forward pass; ratio = 1).
            old_logprobs = (None if single_update and not ppo_mode and not use_is
                            else self._fixed_logprobs(self.engine, ids, attention, temperature))
            is_weights, is_metrics = None, {}
            if use_is:  # pi_old / pi_sampler, truncated: the sampler's weights may be older
                is_weights, is_metrics = grpo.truncated_is_weights(old_logprobs, sampler_logprobs, mask,
                                                                   self.algo["is_cap"])
            ref_logprobs = (self._fixed_logprobs(self.ref_model, ids, attention, temperature)
                            if self.ref_model is not None else None)
            if ppo_mode:  # token-level advantages from the critic (GAE); the KL is in the reward
                old_values = self._values(ids, attention)
                kl = (old_logprobs - ref_logprobs if ref_logprobs is not None
                      else torch.zeros_like(old_logprobs))
                token_r = ppo.token_rewards(r, kl, mask, self.algo["beta"])
                A, returns = ppo.gae(token_r, old_values, mask, self.algo["gamma"], self.algo["lam"])
                A = ppo.whiten(A, mask)
                ref_logprobs = None  # not in the loss
        n = ids.shape[0]
        step_metrics: List[Dict[str, float]] = []
        for _ in range(self.algo["num_iterations"]):
            for mb in torch.arange(n, device=self.device).chunk(num_mb):
                mb_metrics = self._policy_update(mb, ids, attention, mask, A, old_logprobs, ref_logprobs,
                                                 temperature, token_advantages=ppo_mode, is_weights=is_weights)
                if ppo_mode:
                    values = self._values(ids[mb], attention[mb], grad=True)
                    vloss, vmetrics = ppo.value_loss(values, old_values[mb], returns[mb], mask[mb],
                                                     self.algo["value_clip"])
                    self.critic.backward(vloss)
                    self.critic.step()
                    mb_metrics.update(vmetrics)
                    mb_metrics["kl"] = float(grpo.masked_mean(kl[mb], mask[mb]))
                mb_metrics["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
                step_metrics.append(mb_metrics)
        out = {k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0]}
        out.update({
            "response_length_mean": sum(lengths) / len(lengths),
            "truncated_fraction": sum(truncated) / len(truncated),
            "advantage_abs_mean": float(A.abs().mean()),
            "overlong_penalty_mean": float(shaping.mean()),
            "lr": self.optimizer.param_groups[0]["lr"],
            "learner_seconds": time.perf_counter() - start,
            "learner_peak_memory_mb": self._peak_memory_mb(),
            **is_metrics,
        })
        return out

    def _sampler_logprobs(self, sampled, starts, mask):
        """The sampler's log-probs laid out like the learner's targets [N, T-1]; None when
        some completion has none (greedy outputs, or groups from elsewhere)."""
        if any(lps is None for lps in sampled):
            return None
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for i, (lps, start) in enumerate(zip(sampled, starts)):
            out[i, start - 1: start - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return out.to(self.device)

    def _policy_update(self, mb, ids, attention, mask, A, old_logprobs, ref_logprobs, temperature: float,
                       token_advantages: bool, is_weights=None) -> Dict[str, float]:
        """One optimizer step of the policy on minibatch `mb` (row indices), in micro-batches
        whose gradients accumulate; returns the minibatch's metrics. `A` is one advantage per
        row, or per token with `token_advantages` (PPO, whose KL is in the reward, not here)."""
        num_tokens = None
        if self.algo["loss_agg"] == "token-mean":  # the batch's tokens, over every rank
            num_tokens = self._global_sum(mask[mb].sum()) / self.world_size
        micros = self._micro_batches(mb, attention)
        # Each micro-batch's loss is weighted so that their sum is the minibatch's loss.
        if self.algo["loss_agg"] == "seq-mean-token-mean":
            rows = [float(mask[m].any(dim=1).sum()) for m in micros]
        else:
            rows = [float(len(m)) for m in micros]
        total_rows = max(sum(rows), 1.0)
        mb_metrics: Dict[str, float] = {}
        for j, micro in enumerate(micros):
            T = ids.shape[1]
            if len(micros) > 1:  # accumulate; reduce and step after the last micro-batch
                self.engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
                T = int(attention[micro].sum(dim=1).max())  # trim the padding it does not need
            logprobs, entropy = self._token_logprobs(self.engine, ids[micro, :T], attention[micro, :T], temperature,
                                                     entropy=True)
            loss, metrics = grpo.policy_loss(
                logprobs,
                logprobs.detach() if old_logprobs is None else old_logprobs[micro, :T - 1],
                None if ref_logprobs is None else ref_logprobs[micro, :T - 1],
                A[micro, :T - 1] if token_advantages else A[micro], mask[micro, :T - 1],
                clip_low=self.algo["clip_low"], clip_high=self.algo["clip_high"],
                beta=0.0 if token_advantages else self.algo["beta"],
                kl_estimator=self.algo["kl_estimator"],
                # Dr. GRPO divides by a constant, the longest completion allowed.
                loss_agg=self.algo["loss_agg"], max_length=self.algo["max_length"],
                ratio_level=self.algo["ratio_level"], num_tokens=num_tokens,
                is_weights=None if is_weights is None else is_weights[micro, :T - 1],
            )
            metrics["entropy"] = float(grpo.masked_mean(entropy, mask[micro, :T - 1]))
            weight = 1.0 if num_tokens is not None or len(micros) == 1 else rows[j] / total_rows
            self.engine.backward(loss * weight if weight != 1.0 else loss)
            for key, value in metrics.items():
                if key == "ratio_max":
                    mb_metrics[key] = max(mb_metrics.get(key, 0.0), value)
                    continue
                share = weight if key == "loss" else 1.0 / len(micros)
                mb_metrics[key] = mb_metrics.get(key, 0.0) + share * value
        self.engine.step()
        mb_metrics["micro_batches"] = float(len(micros))
        return mb_metrics

    def _values(self, ids, attention, grad: bool = False):
        """The critic's value of the state before each token, aligned with the log-probs [N, T-1]."""
        with contextlib.nullcontext() if grad else torch.no_grad():
            return self.critic(input_ids=ids, attention_mask=attention).logits[:, :-1, 0].float()

    def _peak_memory_mb(self) -> float:
        """Peak memory of this rank: CUDA's allocator peak on GPU, the process's peak RSS on CPU."""
        if self.on_gpu:
            return torch.cuda.max_memory_allocated() / 2**20
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def _micro_batches(self, rows, attention) -> List["torch.Tensor"]:
        """Rows of a minibatch in order, cut so that rows x longest row <= the token budget
        (`learner.max_tokens_per_microbatch`; 0 keeps one micro-batch). Every rank ends with
        the same number of micro-batches (the most any rank needs), because under ZeRO-3
        each forward and backward is a collective."""
        budget = self.cfg.get("max_tokens_per_microbatch", 0)
        if budget <= 0:
            return [rows]
        lengths = attention[rows].sum(dim=1).tolist()
        micros: List[List[int]] = []
        current: List[int] = []
        longest = 0
        for row, length in zip(rows.tolist(), lengths):
            if current and (len(current) + 1) * max(longest, length) > budget:
                micros.append(current)
                current, longest = [], 0
            current.append(row)
            longest = max(longest, length)
        micros.append(current)
        target = int(self._global_max(len(micros)))
        while len(micros) < target:  # split the largest micro-batch until every rank has as many
            i = max(range(len(micros)), key=lambda k: len(micros[k]))
            half = len(micros[i]) // 2
            micros[i:i + 1] = [micros[i][:half], micros[i][half:]]
        return [torch.tensor(m, device=self.device) for m in micros]

    def _global_max(self, value: float) -> float:
        import torch.distributed as dist

        total = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return float(total)

    def _global_sum(self, x) -> float:
        import torch.distributed as dist

        total = x.detach().double().reshape(1).clone()
        dist.all_reduce(total)
        return float(total)

    def _global_std(self, r):
        import torch.distributed as dist

        stats = torch.stack([r.sum(), (r * r).sum(), r.new_tensor(float(r.numel()))]).double()
        dist.all_reduce(stats)
        mean = stats[0] / stats[2]
        return float((stats[1] / stats[2] - mean * mean).clamp(min=0).sqrt())

    # ---- weight sync (sender side) and export ---------------------------------------------
    def _sync_tensors(self) -> Dict[str, "torch.Tensor"]:
        """What vLLM loads, by checkpoint name: every state_dict entry. A tied output head is
        sent too, as the embedding it shares: vLLM's layerwise reload expects its own copy and
        otherwise keeps the old one (measured: greedy outputs then differ)."""
        module = self.engine.module
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        # state_dict's keys only: under ZeRO-3 its values are empty placeholders.
        return {name: tensors[name] for name in module.state_dict().keys()}

    def _gathered(self, params):
        """Full copies of `params` for the duration (ZeRO-3 only; other stages hold them whole)."""
        if self.cfg["zero_stage"] != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")],
                                                 modifier_rank=None)

    def weight_spec(self, dtype: str, bucket_mb: float) -> dict:
        # ZeRO-3 placeholders carry their full shape (ds_shape): no gather needed to describe them.
        return weight_sync.make_spec(list(self._sync_tensors().items()), dtype, bucket_mb).to_wire()

    def sync_address(self) -> tuple:
        """Where the sync group's rendezvous (hosted by this rank) will listen, and its backend:
        NCCL when the learner is on a GPU."""
        return node_ip(), free_port(), "nccl" if self.on_gpu else "gloo"

    def init_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.sync_group = weight_sync.join_group(host, port, 0, world_size, timeout_s, backend)

    def broadcast_weights(self, wire_spec: dict) -> Dict[str, float]:
        """Rank 0 packs the weights into buckets and broadcasts each once to every worker.

        Under ZeRO-3 each bucket's parameters are gathered just for that bucket and released
        after it (every rank joins each gather, only rank 0 sends): the sync never holds the
        whole model twice. `sync_gathered_max_mb` reports the most that was gathered at once.
        """
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        named = self._sync_tensors()
        start = time.perf_counter()
        gathered_max = 0
        for bucket in spec.buckets():
            tensors = [named[t.name] for t in bucket]
            with self._gathered(tensors):
                gathered_max = max(gathered_max, self._gathered_bytes())
                if self.rank == 0:
                    flat = weight_sync.pack(tensors, spec.dtype).to(self.sync_group.device)
                    weight_sync.broadcast(self.sync_group, flat)
        if self.rank == 0:
            weight_sync.settle(self.sync_group)
        seconds = time.perf_counter() - start
        return {"sync_bytes": spec.total_bytes, "sync_seconds": seconds,
                "sync_gbps": spec.total_bytes / max(seconds, 1e-9) / 1e9,
                "sync_gathered_max_mb": gathered_max / 2**20}

    def _gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds right now (ZeRO-3: only those gathered)."""
        params = list(self.engine.module.parameters())
        if self.cfg["zero_stage"] == 3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            params = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        return sum(p.numel() * p.element_size() for p in params)

    def save_pretrained(self, folder: str) -> Optional[str]:
        """Write the policy as a Hugging Face folder (rank 0 writes; every rank joins ZeRO-3's gather)."""
        with self._full_state():
            if self.rank == 0:
                module = self.engine.module
                state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
                module.save_pretrained(folder, state_dict=state)
                self.tokenizer.save_pretrained(folder)
                return folder
        return None

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, folder: str) -> None:
        """Every rank writes its DeepSpeed shard and its RNG; rank 0 also the frozen reference
        and the model's config and tokenizer (see cluster/checkpoint.py for the layout)."""
        learner_dir = os.path.join(folder, "learner")
        self.engine.save_checkpoint(learner_dir, tag="ds")
        if self.critic is not None:
            self.critic.save_checkpoint(os.path.join(folder, "critic"), tag="ds")
        torch.save(self._rng_state(), os.path.join(learner_dir, f"rng_rank{self.rank}.pt"))
        reference = self._reference_state() if self.ref_model is not None else None
        if self.rank == 0:
            if reference is not None:
                torch.save(reference, os.path.join(folder, "reference.pt"))
            self.engine.module.config.save_pretrained(os.path.join(folder, "model"))
            self.tokenizer.save_pretrained(os.path.join(folder, "model"))

    def load_checkpoint(self, folder: str) -> None:
        """Restore what save_checkpoint wrote: weights, optimizer, RNG, the reference model."""
        learner_dir = os.path.join(folder, "learner")
        path, _ = self.engine.load_checkpoint(learner_dir, tag="ds", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {learner_dir}")
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(folder, "critic"), tag="ds", load_optimizer_states=True)
        self._set_rng_state(torch.load(os.path.join(learner_dir, f"rng_rank{self.rank}.pt"), weights_only=False))
        if self.algo["beta"] > 0:
            self.ref_model = self._frozen_reference(torch.load(os.path.join(folder, "reference.pt"), map_location="cpu"))

    def _rng_state(self) -> dict:
        import numpy as np

        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.on_gpu:
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def _set_rng_state(self, state: dict) -> None:
        import numpy as np

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if self.on_gpu and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])

    def state_copy(self) -> Dict[str, "object"]:
        """Full parameters on CPU (for tests)."""
        with self._full_state():
            return {k: v.detach().cpu().clone() for k, v in self.engine.module.state_dict().items()}
