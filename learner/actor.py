"""One DeepSpeed ZeRO data-parallel rank of the policy learner, as a Ray actor.

The Ray-facing side of the learner: distributed set-up, the engines (learner/engines.py), the
supervised warm-up, checkpoints with RNG state, Hugging Face export and, on rank 0, the sender
of the weight-sync channel. The update itself is learner/update.py; the collectives it needs
are learner/collectives.py.
"""
from __future__ import annotations

import os
import random
import time
from typing import Dict, List, Optional

import torch

from common import heap, weight_sync
from common.config import AlgoConfig, LearnerConfig
from common.ray_utils import free_port, node_ip
from learner import engines
from learner.batching import MicroBatcher, flatten, model_tokens_only, pad
from learner.logprobs import token_logprobs
from learner.update import make_update, shape_rewards


class LearnerRank:
    @heap.started_without_full_collections  # DeepSpeed's and transformers' imports, the model's load
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 cfg: LearnerConfig, algo: AlgoConfig, max_new_tokens: int, seed: int):
        """`max_new_tokens`: the longest completion (Dr. GRPO's constant divisor, DAPO's limit)."""
        self.rank, self.world_size = rank, world_size
        self.cfg, self.algo, self.max_new_tokens = cfg, algo, max_new_tokens
        self.on_gpu = torch.cuda.is_available() and cfg.num_gpus_per_rank > 0
        self._init_distributed(master_addr, master_port)
        torch.manual_seed(seed)
        from transformers import AutoTokenizer

        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Llama-style tokenizers have no pad token: any id works under the attention mask.
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.warmup_examples: List[tuple] = []
        self.ds_config = engines.ds_config(cfg, self.on_gpu)
        # Under ZeRO-3 kept for the rank's life: the reference is built partitioned later too.
        self._zero3_models = engines.zero3_models(self.ds_config)
        checkpointed = engines.checkpointing(cfg, self.on_gpu)
        self.engine, self.optimizer = engines.policy_engine(model_path, cfg, self.ds_config, self.dtype, checkpointed)
        self.device = self.engine.device
        self.critic = (engines.critic_engine(model_path, cfg, algo, self.ds_config, self.dtype, checkpointed)
                       if algo.adv_estimator == "gae" else None)
        self.micro = MicroBatcher(cfg.max_tokens_per_microbatch, self.device)
        self.update = make_update(algo, cfg.minibatches, max_new_tokens, self.micro, world_size, self.critic)
        self.ref_model = None
        self.lora = False  # GRPO trains LoRA adapters (learner.lora.rank > 0), from the reference's snapshot on
        self.sync_group = None
        self._send_buffers: Optional[List[torch.Tensor]] = None  # see _staging

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        # Ray sets none of torch.distributed's variables; DeepSpeed reads them from the env.
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0"})
        if not self.on_gpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
            # Set by the driver for the mode and the node's CPUs (cluster/preflight.plan_threads);
            # 0 (a caller that plans nothing) keeps the old one thread per rank.
            torch.set_num_threads(max(self.cfg.num_threads, 1))
        import deepspeed

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

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- supervised warm-up --------------------------------------------------------------
    def load_warmup(self, examples: List[tuple], end_ids: Optional[List[int]] = None) -> int:
        """Tokenise the (prompt, target) pairs once; the warm-up then runs in chunks. A target is
        text, or (text, trained) segments (a tool-using trace: each segment tokenized on its
        own, as an episode is, and the untrained ones out of the loss). Each target ends with
        `end_ids` (a chat format's end-of-turn token), by default the tokenizer's EOS."""
        if end_ids is None:
            end_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.warmup_examples = []
        for prompt, target in examples:
            segments = [(target, True)] if isinstance(target, str) else list(target)
            ids, mask = [], []
            for text, trained in segments:
                piece = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(trained)] * len(piece)
            self.warmup_examples.append((self.tokenizer(prompt)["input_ids"], ids + list(end_ids),
                                         mask + [1] * len(end_ids)))
        return len(self.warmup_examples)

    def warmup(self, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        """Supervised steps on the loaded pairs; loss on the trained target tokens only.

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
            starts = [len(encoded[i][0]) for i in batch]
            ids, attention, mask = pad([encoded[i][0] + encoded[i][1] for i in batch], starts, self.pad_id,
                                       self.device)
            mask = model_tokens_only(mask, [encoded[i][2] for i in batch], starts)
            logprobs = token_logprobs(self.engine, ids, attention, targets=mask)
            loss = -(logprobs * mask).sum() / mask.sum()
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss.detach()))
        return losses  # train_step sets the GRPO lr of each step itself

    # ---- the frozen reference ----------------------------------------------------------------
    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as pi_ref (GRPO starts from the warmed-up model)."""
        if self.cfg.lora.rank:
            self._start_lora()
            return
        if self.algo.beta <= 0:
            return  # beta = 0 needs no reference model at all
        self.ref_model = engines.reference_from_policy(self.engine.module, self.ds_config, self.dtype, self.device,
                                                       self.on_gpu)

    def _start_lora(self, base_state: Optional[dict] = None) -> None:
        """From here on GRPO trains LoRA adapters on the current policy (or on `base_state`, a
        checkpoint's base): a fresh base model gets its weights (under ZeRO-3 partition by
        partition), the old engine and its optimizer go, and the new engine's optimizer holds
        only the adapters. pi_ref is the same engine with its adapters off."""
        old = self.engine.module
        base = engines.fresh_base(old.config, self.dtype, engines.checkpointing(self.cfg, self.on_gpu))
        zero3 = self.cfg.zero_stage == 3
        if base_state is None and zero3:
            engines.copy_partitions(old, base)
        elif base_state is None:
            base.load_state_dict(old.state_dict())
        elif zero3:
            engines.load_partitions(base, base_state)
        else:
            base.load_state_dict(base_state, strict=False)
            base.tie_weights()
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = self.optimizer = old = None
        self.engine, self.optimizer = engines.lora_engine(base, self.cfg, self.ds_config)
        self.lora = True
        self.ref_model = engines.AdaptersOff(self.engine) if self.algo.beta > 0 else None

    def trained_numel(self) -> Dict[str, int]:
        """Elements with optimizer state on this rank, and every parameter's (tests)."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {"optimizer_params": sum(p.numel() for p in params), "state": sum(t.numel() for t in state),
                "trainable": sum(p.numel() for p in self.engine.module.parameters() if p.requires_grad),
                "all": sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())}

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
        self._reset_peak_memory()
        self._set_lr(lr)
        batch = flatten(groups, self.pad_id, self.device)
        shaping = shape_rewards(batch, self.algo, self.max_new_tokens)
        metrics = self.update.run(self.engine, self.ref_model, batch, temperature)
        return {
            **metrics,
            "response_length_mean": sum(batch.lengths) / len(batch.lengths),
            "truncated_fraction": sum(batch.truncated) / len(batch.truncated),
            "overlong_penalty_mean": float(shaping.mean()),
            "lr": self.optimizer.param_groups[0]["lr"],
            "learner_seconds": time.perf_counter() - start,
            "learner_peak_memory_mb": self._peak_memory_mb(),
        }

    def _reset_peak_memory(self) -> None:
        """The peak counter back to what is in use now, so that each step reports its own peak:
        CUDA's allocator peak on GPU; on CPU the kernel's VmHWM (`ru_maxrss` cannot be reset),
        reset by writing 5 to /proc/self/clear_refs (Linux 4.0 on; elsewhere the peak since start)."""
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def _peak_memory_mb(self) -> float:
        """This rank's peak memory since `_reset_peak_memory`: CUDA's allocator peak on GPU, the
        process's peak RSS (VmHWM) on CPU."""
        if self.on_gpu:
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            with open("/proc/self/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024  # kB
        except (OSError, StopIteration):
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    # ---- weight sync (sender side) and export ---------------------------------------------
    def _sync_tensors(self, part: str = "policy") -> Dict[str, "torch.Tensor"]:
        """What vLLM loads, by checkpoint name. `policy`: every state_dict entry of the model, or
        with LoRA's adapter push only the adapters (by peft's saved names); `base`: a LoRA
        policy's base by the plain model's names. A tied output head is sent too, as the
        embedding it shares: vLLM's layerwise reload expects its own copy and otherwise keeps
        the old one (measured: greedy outputs then differ)."""
        module = self.engine.module
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        # state_dict's keys only: under ZeRO-3 its values are empty placeholders.
        names = list(module.state_dict().keys())
        if not self.lora:
            return {name: tensors[name] for name in names}
        if part == "policy" and self.cfg.lora.push == "adapter":
            return {engines.adapter_name(n): tensors[n] for n in names if engines.LORA_MARK in n}
        return {engines.base_name(n): tensors[n] for n in names if engines.LORA_MARK not in n}

    def weight_spec(self, dtype: str, bucket_mb: float, part: str = "policy") -> Optional[dict]:
        """The push's spec; `base`: None unless the push sends adapters (the engines then need
        the base once, before the first adapters and after an engine's restart). An adapter
        spec carries the adapter's peft config (`adapter_config`), which the engines serve it by."""
        adapters = self.lora and self.cfg.lora.push == "adapter"
        if part == "base" and not adapters:
            return None
        # ZeRO-3 placeholders carry their full shape (ds_shape): no gather needed to describe them.
        wire = weight_sync.make_spec(list(self._sync_tensors(part).items()), dtype, bucket_mb).to_wire()
        wire["part"] = part
        if part == "policy" and adapters:
            wire["adapter_config"] = engines.adapter_config_dict(self.engine.module)
        return wire

    def sync_address(self) -> tuple:
        """Where the sync group's rendezvous (hosted by this rank) will listen, and its backend:
        NCCL when the learner is on a GPU."""
        return node_ip(), free_port(), "nccl" if self.on_gpu else "gloo"

    def init_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.sync_group = None  # the old group's connections close first
        self.sync_group = weight_sync.join_group(host, port, 0, world_size, timeout_s, backend)

    def leave_weight_sync(self) -> None:
        """Drop the sync group: its connections close, so a receiver still waiting in a broadcast
        that will not come (a peer died mid-push) fails now instead of at the group's timeout."""
        self.sync_group = None

    def broadcast_weights(self, wire_spec: dict) -> Dict[str, float]:
        """Rank 0 packs the weights into buckets and broadcasts each once to every worker.

        Under ZeRO-3 each bucket's parameters are gathered just for that bucket and released
        after it (every rank joins each gather, only rank 0 sends): the sync never holds the
        whole model twice. `sync_gathered_max_mb` reports the most that was gathered at once.
        """
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        part = wire_spec.get("part", "policy")
        named = self._sync_tensors(part)
        # The merged push: each adapted weight is sent as W + scale B A, computed per bucket.
        pairs = (engines.lora_pairs(self.engine.module)
                 if self.lora and part == "policy" and self.cfg.lora.push == "merged" else {})
        clock = weight_sync.PushClock(self.sync_group if self.rank == 0 else None)
        gathered_max, pack_s = 0, 0.0
        # Shared memory: the buckets are written into the file and only their numbers travel.
        views = weight_sync.shm_buckets(spec) if spec.shm_path and self.rank == 0 else None
        in_flight = None  # (tensor, work) of the broadcast on the wire while the next is packed
        for i, bucket in enumerate(spec.buckets()):
            tensors = [named[t.name] for t in bucket]
            extra = [p for t in bucket if t.name in pairs for p in pairs[t.name][:2]]
            with engines.gathered(tensors + extra, self.cfg.zero_stage):
                gathered_max = max(gathered_max, self._gathered_bytes())
                if self.rank == 0:
                    packed = time.perf_counter()
                    tensors = [engines.merged(w, pairs[t.name]) if t.name in pairs else w
                               for t, w in zip(bucket, tensors)]
                    flat = views[i] if views is not None else self._staging(spec, bucket, i % 2)
                    weight_sync.pack_into(tensors, flat)
                    pack_s += time.perf_counter() - packed
            if self.rank == 0:
                if in_flight is not None:
                    in_flight[1].wait()
                if views is not None:
                    flat = torch.tensor([i], dtype=torch.int64)  # "bucket i is written"
                in_flight = (flat, weight_sync.start_broadcast(self.sync_group, flat))
        if in_flight is not None:
            in_flight[1].wait()
        if self.rank == 0:
            weight_sync.settle(self.sync_group)
        seconds = clock.seconds()
        return {"sync_bytes": spec.total_bytes, "sync_seconds": seconds,
                "sync_gbps": spec.total_bytes / max(seconds, 1e-9) / 1e9,
                "sync_pack_seconds": pack_s, "sync_gathered_max_mb": gathered_max / 2**20}

    def _staging(self, spec: weight_sync.WeightSpec, bucket, slot: int) -> "torch.Tensor":
        """One of two send buffers, kept from push to push: on CPUs a fresh 64 MB buffer per bucket
        costs its page faults every time (bench/weight_sync.py: most of a push's packing was
        faulting in new pages). Two, because one may still be on the wire while the next is packed;
        a slot is reused only after its broadcast finished. On GPUs the caching allocator reuses
        memory already."""
        if self.sync_group.device != "cpu":
            return weight_sync.empty_bucket(bucket, spec.dtype, self.sync_group.device)
        numel = sum(t.numel for t in bucket)
        buffers = self._send_buffers
        if buffers is None or buffers[0].dtype != weight_sync.DTYPES[spec.dtype] or buffers[0].numel() < numel:
            size = max(numel, spec.bucket_bytes // spec.itemsize)
            buffers = self._send_buffers = [torch.empty(size, dtype=weight_sync.DTYPES[spec.dtype]) for _ in range(2)]
        return buffers[slot][:numel]

    def shm_free_bytes(self) -> int:
        """Free bytes of /dev/shm on this node (0 without one): a container's default 64 MB cannot
        hold a model, and writing past a tmpfs's end kills the writer (SIGBUS)."""
        try:
            stat = os.statvfs("/dev/shm")
        except OSError:
            return 0
        return stat.f_bavail * stat.f_frsize

    def unlink_sync_file(self, path: str) -> None:
        """Every receiver has mapped the shared file: its name can go (the mappings stay)."""
        weight_sync.unlink_shm(path)

    def broadcast_raw(self, wire_spec: dict) -> Dict[str, float]:
        """Rank 0 broadcasts buckets of the sync's sizes with nothing packed: a plain broadcast of
        the same bytes over the same group, the yardstick of the sync's rate (bench/weight_sync.py)."""
        spec = weight_sync.WeightSpec.from_wire(wire_spec)
        start = time.perf_counter()
        for bucket in spec.buckets():
            weight_sync.broadcast(self.sync_group, weight_sync.empty_bucket(bucket, spec.dtype, self.sync_group.device))
        weight_sync.settle(self.sync_group)
        return {"sync_seconds": time.perf_counter() - start}

    def _gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds right now (ZeRO-3: only those gathered)."""
        params = list(self.engine.module.parameters())
        if self.cfg.zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            params = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        return sum(p.numel() * p.element_size() for p in params)

    def save_pretrained(self, folder: str, part: str = "merged") -> Optional[str]:
        """Write the policy as a Hugging Face folder (rank 0 writes; every rank joins ZeRO-3's
        gather). With LoRA, `part`: `merged`, the model with its adapters merged in and the
        adapter folder (peft's save_pretrained) in `folder`/adapter; `adapter`, the adapter
        folder alone; `base`, the base model alone."""
        module = self.engine.module
        state = engines.full_state(module, self.cfg.zero_stage, keep=self.rank == 0)  # one parameter at a time
        if self.rank != 0:
            return None
        if self.lora:
            base, _ = engines.split_state(state)
            if part != "base":
                adapter_dir = folder if part == "adapter" else os.path.join(folder, "adapter")
                module.save_pretrained(adapter_dir, state_dict=state)
                self.tokenizer.save_pretrained(adapter_dir)
                if part == "adapter":
                    return folder
                base = engines.merged_state(base, engines.adapters_by_weight(state, module.peft_config["default"]))
            module, state = module.get_base_model(), base
        module.save_pretrained(folder, state_dict=state)
        self.tokenizer.save_pretrained(folder)
        return folder

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, folder: str) -> None:
        """Every rank writes its DeepSpeed shard and its RNG; rank 0 also the frozen reference
        and the model's config and tokenizer (see cluster/checkpoint.py for the layout)."""
        learner_dir = os.path.join(folder, "learner")
        # With LoRA the frozen base is not DeepSpeed's to save: base.pt holds it (below).
        self.engine.save_checkpoint(learner_dir, tag="ds", exclude_frozen_parameters=self.lora)
        if self.critic is not None:
            self.critic.save_checkpoint(os.path.join(folder, "critic"), tag="ds")
        torch.save(self._rng_state(), os.path.join(learner_dir, f"rng_rank{self.rank}.pt"))
        if self.lora:
            self._save_lora(folder)
        reference = (engines.full_state(engines.unwrapped(self.ref_model), self.cfg.zero_stage, keep=self.rank == 0)
                     if self.ref_model is not None and not self.lora else None)
        if self.rank == 0:
            if reference is not None:
                torch.save(reference, os.path.join(folder, "reference.pt"))
            self.engine.module.config.save_pretrained(os.path.join(folder, "model"))
            self.tokenizer.save_pretrained(os.path.join(folder, "model"))

    def _save_lora(self, folder: str) -> None:
        """A LoRA policy's base (`base.pt`, the plain model's names; the frozen reference too)
        and its adapter folder (`adapter/`, what `grpo export` writes)."""
        state = engines.full_state(self.engine.module, self.cfg.zero_stage, keep=self.rank == 0)
        if self.rank == 0:
            base, _ = engines.split_state(state)
            torch.save(base, os.path.join(folder, "base.pt"))
            self.engine.module.save_pretrained(os.path.join(folder, "adapter"), state_dict=state)

    def load_checkpoint(self, folder: str) -> None:
        """Restore what save_checkpoint wrote: weights, optimizer, RNG, the reference model."""
        learner_dir = os.path.join(folder, "learner")
        lora_base = os.path.join(folder, "base.pt")
        if os.path.exists(lora_base):  # memory-mapped: under ZeRO-3 a rank reads only its partitions' pages
            self._start_lora(torch.load(lora_base, map_location="cpu", mmap=True))
        path, _ = self.engine.load_checkpoint(learner_dir, tag="ds", load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=not self.lora)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {learner_dir}")
        if self.critic is not None:
            self.critic.load_checkpoint(os.path.join(folder, "critic"), tag="ds", load_optimizer_states=True)
        self._set_rng_state(torch.load(os.path.join(learner_dir, f"rng_rank{self.rank}.pt"), weights_only=False))
        if self.algo.beta > 0 and not self.lora:
            # Memory-mapped: under ZeRO-3 a rank reads only its partitions' pages.
            reference = torch.load(os.path.join(folder, "reference.pt"), map_location="cpu", mmap=True)
            self.ref_model = engines.reference_from_state(self.engine.module.config, reference, self.ds_config,
                                                          self.dtype, self.device, self.on_gpu)

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

    # ---- inspection (tests and checks) -------------------------------------------------------
    def state_copy(self) -> Dict[str, "object"]:
        """Full parameters on CPU."""
        return engines.full_state(self.engine.module, self.cfg.zero_stage)

    def checkpointed_blocks(self) -> int:
        """Blocks of the policy that recompute their activations in the backward pass."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        return sum(1 for m in self.engine.module.modules()
                   if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training)

    def reference_numel(self) -> Dict[str, int]:
        """Elements of pi_ref this rank holds (under ZeRO-3 its partitions), and the full model's."""
        params = list(engines.unwrapped(self.ref_model).parameters())
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        return {"held": held, "full": sum(getattr(p, "ds_numel", p.numel()) for p in params)}

    def reference_state(self) -> Dict[str, "object"]:
        """pi_ref's full parameters on CPU (a collective under ZeRO-3)."""
        return engines.full_state(engines.unwrapped(self.ref_model), self.cfg.zero_stage)
