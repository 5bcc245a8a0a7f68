"""The DeepSpeed engines of one learner rank: the policy, PPO's value model, the frozen reference.

Every engine is built from the same generated DeepSpeed config (ZeRO stage, clipping, bf16 on
GPUs), with `learner.deepspeed` merged over it.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
from typing import Callable, Dict, Iterator, List, Optional

import torch

from common.config import AlgoConfig, LearnerConfig


def import_deepspeed():
    """`import deepspeed`, without the MLflow import that DeepSpeed's autotuner makes at its
    own import when MLflow is installed (the `mlflow` logger's extra): MLflow's import is most
    of DeepSpeed's (`python -X importtime -c "import deepspeed"`) and every learner rank paid it
    at start for `deepspeed --autotuning`, which this learner never runs. A process that imported
    MLflow before keeps it; one that imports it later gets it."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner goes without
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`, recursively for nested dicts (DeepSpeed settings from the config)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def ds_config(cfg: LearnerConfig, on_gpu: bool) -> dict:
    config = deep_merge({
        "train_micro_batch_size_per_gpu": 1,  # batches are formed here, not by DeepSpeed
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 10**9,
    }, dict(cfg.deepspeed or {}))
    return with_fp32_accumulation(config, dict(cfg.deepspeed or {}))


def with_fp32_accumulation(config: dict, user: dict) -> dict:
    """Gradients accumulate over micro-batches in float32 when the model is in a 16-bit dtype
    (`data_types.grad_accum_dtype`; DeepSpeed's default is the model's dtype, which loses the
    small micro-batches' share of a sum of ten or more). Always, not only with several
    micro-batches: how many a step has depends on its completions' lengths, known only then.
    ZeRO stage 0 is left as it is: DeepSpeed refuses the mix there (its DDP path reduces in
    the model's dtype). A `data_types.grad_accum_dtype` in `learner.deepspeed` wins."""
    sixteen_bit = any(dict(config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))
    stage = int(dict(config.get("zero_optimization") or {}).get("stage", 0))
    if not sixteen_bit or stage < 1 or "grad_accum_dtype" in dict(user.get("data_types") or {}):
        return config
    return deep_merge(config, {"data_types": {"grad_accum_dtype": "fp32"}})


OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}

OFFLOAD_DEVICES = ("cpu", "nvme")


def offloads_optimizer(config: dict) -> bool:
    """Whether the DeepSpeed config offloads the optimizer (ZeRO-Offload: `offload_optimizer.device`
    cpu or nvme; common/config.py refuses any other device)."""
    offload = dict(dict(config.get("zero_optimization") or {}).get("offload_optimizer") or {})
    return offload.get("device") in OFFLOAD_DEVICES


def make_optimizer(params, cfg: LearnerConfig, config: dict):
    """The rank's optimizer over `params`. Offloaded, it is DeepSpeed's CPU Adam (AdamW's
    arithmetic, torch's defaults): DeepSpeed refuses a client torch optimizer with ZeRO-Offload
    (`zero_force_ds_cpu_optimizer`, true by default), and a torch AdamW stepping on the host would
    run on the threads Ray gives the actor's torch, one for a fractional CPU. The CPU Adam runs
    vectorised on OpenMP threads, `host_optimizer_threads`."""
    if offloads_optimizer(config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_mode=True)
    return OPTIMIZERS[cfg.optimizer](params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def host_optimizer_threads(cfg: LearnerConfig, on_gpu: bool) -> int:
    """Threads for the offloaded optimizer's step: the rank's CPUs (on CPUs the planned
    `learner.num_threads`; on GPUs the CPUs Ray reserved for the actor, learner.num_cpus_per_rank)."""
    if not on_gpu:
        return max(cfg.num_threads, 1)
    import ray

    # Only a Ray worker has assigned resources (a driver process, e.g. a test that started Ray,
    # has none and Ray asserts on the call).
    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0) if in_actor else 0.0
    return max(1, int(cpus or cfg.num_cpus_per_rank))


def prepare_host_optimizer(cfg: LearnerConfig, on_gpu: bool) -> str:
    """Before a rank's first engine with an offloaded optimizer: the op's threads set
    (`host_optimizer_line` says how many)."""
    # The op's OpenMP runtime is not torch's (torch ships its own): it reads OMP_NUM_THREADS
    # when the op is loaded.
    os.environ["OMP_NUM_THREADS"] = str(host_optimizer_threads(cfg, on_gpu))
    return host_optimizer_line(cfg, on_gpu)


def host_optimizer_line(cfg: LearnerConfig, on_gpu: bool) -> Optional[str]:
    """The start line of a run whose optimizer is offloaded (None otherwise): on how many threads
    DeepSpeed's CPU Adam steps, and whether its op must be compiled first (a JIT build of minutes
    on a few cores, behind a lock file in torch's extensions folder that a process killed while
    building leaves behind: every later build then waits on it). The driver says it before the
    learner ranks start, on its own node's extensions folder."""
    if not offloads_optimizer(dict(cfg.deepspeed or {})):
        return None
    threads = host_optimizer_threads(cfg, on_gpu)
    line = f"ZeRO-Offload: the optimizer steps on the host with DeepSpeed's CPU Adam, {threads} thread{'s' if threads != 1 else ''} (the rank's CPUs)"
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("cpu_adam"):
        return line + "; its op is prebuilt"
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory("cpu_adam", verbose=False)
    if os.path.exists(os.path.join(folder, "cpu_adam.so")):
        return line + f"; its op is built ({folder})"
    line += (f"; compiling its op first (minutes on a few cores, once per machine, into {folder}; "
             "`python -m learner.build_ops` builds it ahead)")
    if os.path.exists(os.path.join(folder, "lock")):
        line += (f"; its lock file {os.path.join(folder, 'lock')} is held: if no other process is building it, "
                 "a killed build left it behind and it must be removed")
    return line


def checkpointing(cfg: LearnerConfig, on_gpu: bool) -> bool:
    """Whether the trained models recompute activations (`learner.gradient_checkpointing`)."""
    return on_gpu if cfg.gradient_checkpointing is None else bool(cfg.gradient_checkpointing)


def prepare_for_training(model, checkpointed: bool):
    """When `checkpointed`, the model's own gradient checkpointing (the forwards pass
    use_cache=False: learner/logprobs.py). Transformers checkpoints only modules in training
    mode and `from_pretrained` returns the model in eval mode: train mode turns it on."""
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def zero3_bounds(model, config: dict) -> dict:
    """`config` with ZeRO-3's working set sized to the model's largest transformer block.
    DeepSpeed's defaults count in fixed numbers of elements (up to 1e9 parameters kept gathered
    and reused, 5e8 gradients per reduce bucket), sized for billion-parameter models: on a model
    smaller than that every parameter stays gathered from the forward to the backward and the
    bucket holds every gradient, so each rank holds whole copies after all. Here a rank keeps
    about two blocks gathered, prefetches one, reduces gradients a block at a time and steps
    the optimizer over a block's partitions at a time. A value set in
    `learner.deepspeed.zero_optimization` wins."""
    if zero_stage(config) != 3:
        return config
    from transformers.modeling_layers import GradientCheckpointingLayer

    def numel(module) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())

    blocks = [numel(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    block = max(blocks) if blocks else numel(model)
    # The optimizer's sub-groups, about a block's partitions each: for each sub-group's step
    # DeepSpeed copies its gradient partitions into a buffer as large as the largest sub-group
    # (beside the partitions it accumulates them in), and one sub-group of the whole model (its
    # default) made that buffer a second copy of every gradient partition (bench/memory_scale.py,
    # ZeRO-3 at rest above its formula).
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    bounds = {"stage3_max_live_parameters": 2 * block, "stage3_max_reuse_distance": block,
              "stage3_prefetch_bucket_size": block, "reduce_bucket_size": block,
              "sub_group_size": max(1, block // world)}
    return deep_merge({"zero_optimization": bounds}, config)


def policy_engine(model_path: str, cfg: LearnerConfig, config: dict, dtype, checkpointed: bool = False):
    """(engine, optimizer) of the policy."""
    import deepspeed

    model = pretrained_base(model_path, dtype, checkpointed)
    optimizer = make_optimizer(model.parameters(), cfg, config)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero3_bounds(model, config))
    return engine, optimizer


def pretrained_base(model_path: str, dtype, checkpointed: bool):
    """The model at `model_path`, ready to train (under ZeRO-3, loaded partitioned: see
    `zero3_models`)."""
    from transformers import AutoModelForCausalLM

    return prepare_for_training(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype), checkpointed)


def critic_engine(model_path: str, cfg: LearnerConfig, algo: AlgoConfig, config: dict, dtype,
                  checkpointed: bool = False):
    """PPO's value model: the policy's architecture with a scalar head per token, its own
    DeepSpeed engine and optimizer (what GRPO does without)."""
    import deepspeed
    from transformers import AutoModelForTokenClassification

    critic = prepare_for_training(
        AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=dtype), checkpointed)
    if offloads_optimizer(config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(critic.parameters(), lr=algo.critic_lr, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=critic, optimizer=optimizer, config=zero3_bounds(critic, config))
    return engine


def zero3_models(config: dict):
    """Under ZeRO-3, what makes transformers build every model of this process partitioned
    from the start (`deepspeed.zero.Init` in `from_pretrained` and `from_config`, each rank
    allocating only its partition; the checkpoint read in layer by layer): an HfDeepSpeedConfig,
    which transformers holds by a weak reference, so the caller keeps it while it builds models.
    Otherwise None, and any earlier one is forgotten (a rank rebuilt with another stage)."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    if zero_stage(config) != 3:
        unset_hf_deepspeed_config()
        return None
    return HfDeepSpeedConfig(config)


def zero_stage(config: dict) -> int:
    return int(config["zero_optimization"].get("stage", 0))


def reference_from_policy(policy, config: dict, dtype, device, on_gpu: bool):
    """pi_ref, a frozen copy of the policy module as it is now. Under ZeRO-3 it is built
    partitioned and each rank copies its own partition of every parameter from the policy's:
    no rank ever holds the whole model."""
    if zero_stage(config) != 3:
        return _whole_reference(policy.config, full_state(policy, zero_stage(config)), dtype, device)
    engine = _partitioned_reference(policy.config, config, dtype, on_gpu)
    copy_partitions(policy, engine.module)
    return engine


def reference_from_state(model_config, state: dict, config: dict, dtype, device, on_gpu: bool):
    """pi_ref from a full state dict (a checkpoint's, memory-mapped: under ZeRO-3 each rank
    reads only its partition of each tensor)."""
    if zero_stage(config) != 3:
        return _whole_reference(model_config, state, dtype, device)
    engine = _partitioned_reference(model_config, config, dtype, on_gpu)
    load_partitions(engine.module, state)
    return engine


def _whole_reference(model_config, state: dict, dtype, device):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    ref.load_state_dict(state, strict=True)
    return ref.to(device).eval().requires_grad_(False)


def _partitioned_reference(model_config, config: dict, dtype, on_gpu: bool):
    """A DeepSpeed engine with no optimizer around a model built partitioned (`zero3_models`
    is alive), gathered layer by layer in its forward. Its weights are random until filled."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model_config, dtype=dtype).requires_grad_(False)
    inference = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "bf16": {"enabled": on_gpu},
                 "zero_optimization": dict(config["zero_optimization"])}
    engine, _, _, _ = deepspeed.initialize(model=ref, config=zero3_bounds(ref, inference))
    engine.eval()  # DeepSpeed's eval() returns None, not the engine
    return engine


def _release_whole(target) -> None:
    """Parameters of `target` held whole (ZeRO-3's persistent small ones, once used) go back to
    their partitions, so that their next use gathers the partitions written now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    whole = [p for p in target.parameters() if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
    if whole:
        whole[0].partition(param_list=whole, has_been_updated=False)


@torch.no_grad()
def copy_partitions(source, target) -> None:
    """Every ZeRO-3 parameter of `target` := the same one of `source` (the same architecture,
    partitioned over the same ranks), each rank copying only its own partition."""
    _release_whole(target)
    sources = dict(source.named_parameters())
    for name, param in target.named_parameters():
        partition = sources[name].ds_tensor
        if partition.shape != param.ds_tensor.shape:
            raise RuntimeError(f"{name}: partitions of {tuple(partition.shape)} and {tuple(param.ds_tensor.shape)}")
        param.ds_tensor.copy_(partition)


@torch.no_grad()
def load_partitions(target, state: dict) -> None:
    """Every ZeRO-3 parameter of `target` := its full tensor in `state`, each rank copying only
    the slice its partition holds (DeepSpeed's layout: rank r holds elements [r*n, (r+1)*n)
    of the flat tensor, the last partition padded)."""
    import torch.distributed as dist

    _release_whole(target)
    for name, param in target.named_parameters():
        flat, partition = state[name].reshape(-1), param.ds_tensor
        size = partition.numel()
        start = size * dist.get_rank(group=param.ds_process_group)
        count = max(0, min(size, flat.numel() - start))
        partition.zero_()
        partition.narrow(0, 0, count).copy_(flat.narrow(0, start, count))


def unwrapped(model):
    """The torch module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model, "module", model)


def gathered(params, zero_stage: int):
    """Full copies of `params` for the duration, on every rank (ZeRO-3 only; the other stages
    hold them whole)."""
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")], modifier_rank=None)


def full_state(module, zero_stage: int, keep: bool = True) -> Optional[dict]:
    """The full weights on CPU; None on a rank that does not `keep` them (a collective under
    ZeRO-3: every rank calls it). For small models and tests: what writes a model to disk
    streams `state_blocks` instead, and never holds it whole."""
    out = {}
    for block in state_blocks(module, zero_stage, keep):
        out.update(block)
    return out if keep else None


_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def _block_key(name: str) -> Optional[str]:
    """The numbered prefix (`model.layers.3`: one transformer block, its adapters included); for
    a layer outside the blocks that peft wrapped (an adapted output head), the layer, so that
    its weight and adapters come together; else None."""
    match = _BLOCK.match(name)
    if match:
        return match.group(1)
    for mark in (".base_layer.", LORA_MARK):
        if mark in name:
            return name.split(mark)[0]
    return None


def _blocks(names: List[str]) -> List[List[str]]:
    """`names` in runs that share a `_block_key`, every other name alone."""
    runs: List[List[str]] = []
    last = None
    for name in names:
        key = _block_key(name)
        if key is not None and key == last:
            runs[-1].append(name)
        else:
            runs.append([name])
        last = key
    return runs


def state_blocks(module, zero_stage: int, keep: bool = True,
                 only: Optional[Callable[[str], bool]] = None) -> Iterator[Dict[str, "torch.Tensor"]]:
    """The full weights on CPU one block at a time (`_blocks`: a transformer block and its
    adapters, or one other tensor), only the names `only` accepts if given; empty dicts on a
    rank that does not `keep` them. Under ZeRO-3 a collective (every rank iterates it to the
    end) that gathers one block at a time: beyond its partitions a rank holds one whole block
    and, if it keeps them, the copies the caller still holds. A tied weight is the same tensor
    object under each of its names."""
    state = module.state_dict(keep_vars=True)
    if only is not None:
        state = {name: value for name, value in state.items() if only(name)}
    counts = collections.Counter(id(v) for v in state.values())
    shared = {}  # the copy of each tensor that has several names, kept for its later names
    for names in _blocks(list(state)):
        todo = [state[n] for n in names if id(state[n]) not in shared]
        with gathered(todo, zero_stage):
            block = {}
            for name in names:
                value = state[name]
                if id(value) in shared:
                    copy = shared[id(value)]
                else:
                    copy = value.detach().to("cpu", copy=True) if keep else None
                    if counts[id(value)] > 1:
                        shared[id(value)] = copy
                block[name] = copy
        yield block if keep else {}


# ---- LoRA (peft) ----------------------------------------------------------------------------
LORA_MARK = ".lora_"


def is_adapter(name: str) -> bool:
    return LORA_MARK in name


def lora_config(cfg, base_path: Optional[str] = None):
    """peft's LoraConfig of `learner.lora`: every linear projection unless target_modules names some."""
    from peft import LoraConfig

    targets = list(cfg.target_modules) if cfg.target_modules else "all-linear"
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      task_type="CAUSAL_LM", base_model_name_or_path=base_path)


def lora_engine(base, cfg: LearnerConfig, config: dict):
    """(engine, optimizer) of `base` with LoRA adapters: the base frozen, the optimizer over the
    adapters alone (nothing else has optimizer state or gradients)."""
    import deepspeed
    from peft import get_peft_model

    model = get_peft_model(base, lora_config(cfg.lora, getattr(base.config, "_name_or_path", None)))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trained, cfg, config)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=zero3_bounds(model, config))
    _saves_no_frozen_alias(engine)
    return engine, optimizer


def _saves_no_frozen_alias(engine) -> None:
    """Make `save_checkpoint(exclude_frozen_parameters=True)` drop every frozen tensor. DeepSpeed
    drops the frozen parameters by their `named_parameters()` names, which name a tied weight
    once: a tied output head stayed in the adapters-only file as a second copy of the embedding
    (vocabulary x hidden numbers; the base is saved apart, in `base/`)."""
    whole = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = whole(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = module_state_dict


def fresh_base(model_config, dtype, checkpointed: bool):
    """An empty model of `model_config` to fill with the base's weights (built partitioned while
    an HfDeepSpeedConfig of ZeRO-3 is alive)."""
    from transformers import AutoModelForCausalLM

    return prepare_for_training(AutoModelForCausalLM.from_config(model_config, dtype=dtype), checkpointed)


def base_name(name: str) -> str:
    """A peft model's name of a base tensor as the plain model names it."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """A peft model's name of an adapter tensor as peft's saved adapter (and vLLM) names it."""
    return name.replace(".default.", ".")


def split_state(peft_state: dict):
    """(base, adapters) of a peft model's full state: the base by plain names, the adapters by
    their saved names."""
    base = {base_name(k): v for k, v in peft_state.items() if LORA_MARK not in k}
    adapters = {adapter_name(k): v for k, v in peft_state.items() if LORA_MARK in k}
    return base, adapters


class AdaptersOff:
    """pi_ref of a LoRA policy: the same engine with its adapters switched off (peft's
    `disable_adapter`), so the frozen reference needs no copy of the model."""

    def __init__(self, engine):
        self.engine = engine
        self.module = engine.module

    def __call__(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.engine(*args, **kwargs)


def lora_pairs(module) -> dict:
    """For each adapted linear layer of a peft model, by the plain name of its weight:
    (A, B, scale), what a merge adds: W + scale * B @ A."""
    pairs = {}
    for name, layer in module.named_modules():
        if hasattr(layer, "lora_A") and "default" in getattr(layer, "lora_A", {}):
            pairs[base_name(f"{name}.base_layer.weight")] = (layer.lora_A["default"].weight,
                                                             layer.lora_B["default"].weight,
                                                             layer.scaling["default"])
    return pairs


def merged(weight, pair) -> "torch.Tensor":
    a, b, scale = pair
    return weight.detach() + scale * (b.detach() @ a.detach()).to(weight.dtype)


def adapter_config_dict(peft_model) -> dict:
    """The adapter's peft config as its saved adapter_config.json holds it (plain types)."""
    import json

    config = peft_model.peft_config["default"]
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def adapters_by_weight(peft_state: dict, config) -> dict:
    """From a peft model's full state: (A, B, scale) by the plain name of each adapted weight."""
    scale = config.lora_alpha / config.r
    pairs = {}
    for name, value in peft_state.items():
        if ".lora_A." in name:
            weight = base_name(name.split(".lora_A.")[0] + ".base_layer.weight")
            pairs[weight] = (value, peft_state[name.replace(".lora_A.", ".lora_B.")], scale)
    return pairs


def merged_state(base: dict, pairs: dict) -> dict:
    """The base's weights with the adapters merged in (the merged model's state)."""
    return {name: merged(value, pairs[name]) if name in pairs else value for name, value in base.items()}
