"""One DeepSpeed ZeRO data-parallel rank of the policy learner, as a Ray actor.

The Ray-facing side of the learner: distributed set-up, then each call handed to the part that
does the job: the policy and its reference (learner/policy.py), the supervised warm-up
(learner/warmup.py), the update (learner/update.py), the weight-sync sender
(learner/weight_sender.py) and the checkpoint, RNG state and export
(learner/checkpoint_state.py).
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import torch

from common import heap, weight_sync
from common.config import AlgoConfig, LearnerConfig
from learner import engines
from learner.batching import MicroBatcher, flatten
from learner.checkpoint_state import CheckpointState
from learner.metrics import VERSION_TOKENS
from learner.peak_memory import peak_memory_mb, reset_peak_memory
from learner.policy import PolicyModel
from learner.update import make_update, shape_rewards
from learner.warmup import Warmup
from learner.weight_sender import WeightSender, shm_free_bytes


class LearnerRank:
    @heap.started_without_full_collections  # DeepSpeed's and transformers' imports, the model's load
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 cfg: LearnerConfig, algo: AlgoConfig, max_new_tokens: int, seed: int, adapters_from_start: bool = False):
        """`max_new_tokens`: the longest completion (Dr. GRPO's constant divisor, DAPO's limit);
        `adapters_from_start`: with LoRA, no warm-up trains the whole model first (see
        learner/policy.py)."""
        self.rank, self.world_size = rank, world_size
        self.cfg, self.algo, self.max_new_tokens = cfg, algo, max_new_tokens
        self.on_gpu = torch.cuda.is_available() and cfg.num_gpus_per_rank > 0
        self._init_distributed(master_addr, master_port)
        torch.manual_seed(seed)
        from transformers import AutoTokenizer

        dtype = torch.bfloat16 if self.on_gpu else torch.float32
        if self.on_gpu:
            self._check_logits_fit(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Llama-style tokenizers have no pad token: any id works under the attention mask.
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.warmup_set = Warmup(self.tokenizer, self.pad_id, rank, world_size)
        ds_config = engines.ds_config(cfg, self.on_gpu)
        # Under ZeRO-3 kept for the rank's life: the reference is built partitioned later too.
        self._zero3_models = engines.zero3_models(ds_config)
        checkpointed = engines.checkpointing(cfg, self.on_gpu)
        if engines.offloads_optimizer(ds_config):
            engines.prepare_host_optimizer(cfg, self.on_gpu)  # the driver said it in its start lines
        self.policy = PolicyModel(model_path, cfg, algo, ds_config, dtype, self.on_gpu, checkpointed,
                                  adapters_from_start)
        self.device = self.policy.device
        self.critic = (engines.critic_engine(model_path, cfg, algo, ds_config, dtype, checkpointed)
                       if algo.adv_estimator == "gae" else None)
        self.micro = MicroBatcher(cfg.max_tokens_per_microbatch, self.device, cfg.pack_sequences)
        self.update = make_update(algo, cfg.minibatches, max_new_tokens, self.micro, world_size, self.critic)
        self.sender = WeightSender(self.policy, rank)
        self.state = CheckpointState(self.policy, self.critic, self.tokenizer, rank)

    def _check_logits_fit(self, model_path: str) -> None:
        """Stop before the first step when a micro-batch's logits alone cannot fit on this GPU."""
        from transformers import AutoConfig

        from common.errors import BadInput
        from learner.memory_plan import logits_past_memory

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        error = logits_past_memory(vocab, self.cfg.max_tokens_per_microbatch, 2, total)
        if error:
            raise BadInput(error)

    def __repr__(self) -> str:
        # Ray names the rank's log files' actor (":actor_name:" in its session's worker logs) and
        # its errors by this: which process is which rank, seen from outside the driver.
        return f"LearnerRank(rank={self.rank})"

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        # Ray sets none of torch.distributed's variables; DeepSpeed reads them from the env.
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0"})
        if not self.on_gpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
            # Set by the driver for the mode and the node's CPUs (cluster/loop/launch.plan_threads);
            # 0 (a caller that plans nothing) keeps the old one thread per rank.
            torch.set_num_threads(max(self.cfg.num_threads, 1))
        deepspeed = engines.import_deepspeed()

        if not self.on_gpu:
            # DeepSpeed's CPU backend JIT-loads a shared-memory all-reduce op at start-up, used
            # only by inference_all_reduce, never in training. Loading it waits on a lock file
            # that a rank killed while loading leaves behind (a stopped job, a Ctrl-C): every
            # later learner on the machine then hangs in __init__. Training needs none of it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if self.on_gpu else "gloo"
        deepspeed.init_distributed(dist_backend=backend)

    # ---- supervised warm-up and the reference ------------------------------------------------
    def load_warmup(self, examples: List[tuple], end_ids: Optional[List[int]] = None) -> int:
        """See learner/warmup.py: `Warmup.load`."""
        return self.warmup_set.load(examples, end_ids)

    def warmup(self, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        """See learner/warmup.py: `Warmup.run`."""
        return self.warmup_set.run(self.policy, steps, batch_size, lr, seed)

    def snapshot_reference(self) -> None:
        """Freeze pi_ref (with LoRA: train adapters from here on); see learner/policy.py."""
        self.policy.snapshot_reference()

    # ---- GRPO ----------------------------------------------------------------------------
    def train_step(self, group_refs: list, temperature: float, lr: float) -> Dict[str, float]:
        """One GRPO update on this rank's prompt groups (fetched by reference from the object
        store); returns this rank's metrics."""
        import ray

        return self.train_on(ray.get(list(group_refs)), temperature, lr)

    def train_on(self, groups: list, temperature: float, lr: float) -> Dict[str, float]:
        """One update on these prompt groups. Needs no Ray: the rank works in a plain process
        too (the GPU check runs it so)."""
        start = time.perf_counter()
        reset_peak_memory(self.on_gpu)
        self.policy.set_lr(lr)
        batch = flatten(groups, self.pad_id, self.device)
        shaping = shape_rewards(batch, self.algo, self.max_new_tokens)
        metrics = self.update.run(self.policy.engine, self.policy.ref_model, batch, temperature)
        return {
            **metrics,
            "response_length_mean": sum(batch.lengths) / len(batch.lengths),
            **{f"{VERSION_TOKENS}{v}": float(n) for v, n in batch.version_tokens.items()},
            "truncated_fraction": sum(batch.truncated) / len(batch.truncated),
            "overlong_penalty_mean": float(shaping.mean()),
            "lr": self.policy.optimizer.param_groups[0]["lr"],
            "learner_seconds": time.perf_counter() - start,
            "learner_peak_memory_mb": peak_memory_mb(self.on_gpu),
        }

    # ---- weight sync (sender side): learner/weight_sender.py ---------------------------------
    def weight_spec(self, dtype: str, bucket_mb: float, part: str = "policy") -> Optional[dict]:
        return self.sender.weight_spec(dtype, bucket_mb, part)

    def sync_address(self) -> tuple:
        return self.sender.sync_address()

    def init_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.sender.join(host, port, world_size, timeout_s, backend)

    def leave_weight_sync(self) -> None:
        self.sender.leave()

    def broadcast_weights(self, wire_spec: dict) -> Dict[str, float]:
        return self.sender.push(wire_spec)

    def shm_free_bytes(self) -> int:
        return shm_free_bytes()

    def unlink_sync_file(self, path: str) -> None:
        """Every receiver has mapped the shared file: its name can go (the mappings stay)."""
        weight_sync.unlink_shm(path)

    # ---- checkpoints and export: learner/checkpoint_state.py ---------------------------------
    def save_pretrained(self, folder: str, part: str = "merged") -> Optional[str]:
        return self.state.save_pretrained(folder, part)

    def save_checkpoint(self, folder: str) -> None:
        self.state.save(folder)

    def load_checkpoint(self, folder: str) -> None:
        self.state.load(folder)
