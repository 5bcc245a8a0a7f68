"""The one typed config schema. YAML in `conf/` only overlays it; dotted overrides win.

Light on purpose: imports no torch, Ray or vLLM, so `grpo train --cfg` and config errors are
instant and happen before any actor starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ModelConfig:
    name: str = "tiny"
    """`tiny` builds the built-in character-level Qwen2 model once, in `cache_dir`; `hf` loads `path`."""
    path: Optional[str] = None
    """A Hugging Face folder or hub id. Set for `model=hf`; filled in by the builder for `tiny`."""
    cache_dir: str = "~/.cache/grpo/models"
    """Where the built-in model is built once and reused."""
    hidden_size: int = 128
    """Tiny model only: width."""
    num_layers: int = 2
    """Tiny model only: transformer blocks."""
    num_heads: int = 4
    """Tiny model only: attention heads (head size = hidden_size / num_heads)."""
    intermediate_size: int = 512
    """Tiny model only: MLP width."""
    max_position_embeddings: int = 128
    """Tiny model only: longest prompt + completion in tokens."""
    tie_word_embeddings: bool = True
    """Tiny model only: share the input embedding and the output head."""
    vocab_size: int = 0
    """Tiny model only: rows of the embedding and output head (0: the tokenizer's size, padded
    to 16). Set it to a real model's (151936 for Qwen2.5) to measure memory at that size."""


@dataclass
class DataConfig:
    source: str = "arithmetic"
    """`arithmetic` (built-in generator), `jsonl` (local JSONL or Parquet file) or `hf` (datasets library)."""
    path: Optional[str] = None
    """jsonl: the file. hf: a local folder saved with `save_to_disk` (optional, instead of `name`)."""
    name: Optional[str] = None
    """hf: the dataset name passed to `datasets.load_dataset`."""
    config_name: Optional[str] = None
    """hf: the dataset's configuration (e.g. `main` for gsm8k)."""
    split: str = "train"
    """hf: the split to train on."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt text."""
    answer_key: str = "answer"
    """Field of a row holding the gold answer."""
    heldout_size: int = 200
    """Rows kept out of training and used for the greedy accuracy before/after GRPO."""
    num_train: int = 0
    """arithmetic: training problems to generate (0 = every problem not held out)."""
    min_digits: int = 2
    """arithmetic: fewest digits of an operand (at least 2)."""
    max_digits: int = 2
    """arithmetic: most digits of an operand."""
    prompt_template: Optional[str] = None
    """A format string over the row's fields, e.g. `"{question}\\nPut your final answer within
    \\\\boxed{{}}."` (`{prompt}` is the prompt field; `{{ }}` literal braces). None: the prompt as is."""
    system_prompt: Optional[str] = None
    """A system message (with a chat template) or a paragraph before the prompt (without)."""
    chat_template: str = "auto"
    """`true`: apply the tokenizer's chat template; `false`: never; `auto`: when the tokenizer has
    one and the rows are conversations, a system prompt is set, or the model's name says
    instruct/chat/-it."""
    eval_path: Optional[str] = None
    """An evaluation file (JSONL or Parquet, the same fields): evaluate on it instead of rows held
    out of the training data (which then all train)."""
    eval_split: Optional[str] = None
    """hf: an evaluation split of the same dataset (e.g. `test`), instead of held-out rows."""


@dataclass
class AlgoConfig:
    group_size: int = 8
    """G: completions sampled per prompt."""
    beta: float = 0.04
    """Weight of the k3 KL to the frozen reference, in the loss; 0 loads no reference model."""
    clip_low: float = 0.2
    """PPO clip: ratio floor is 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: ratio ceiling is 1 + clip_high (DAPO's clip-higher uses 0.28)."""
    num_iterations: int = 1
    """mu: passes over each batch of rollouts."""
    adv_scale: str = "group"
    """Advantage scaling: `group` std, `batch` std, or `none` (Dr. GRPO)."""
    adv_estimator: str = "grpo"
    """`grpo` (group-mean baseline), `rloo` (leave-one-out baseline), or `gae`: PPO with a
    critic (a value model of the policy's architecture, its own DeepSpeed engine), the baseline
    that GRPO removes."""
    gamma: float = 1.0
    """gae: discount per token."""
    lam: float = 0.95
    """gae: GAE's lambda."""
    critic_lr: float = 1e-3
    """gae: the value model's learning rate."""
    value_clip: float = 0.2
    """gae: how far a value may move from its old estimate before the value loss stops pulling."""
    kl_estimator: str = "k3"
    """KL estimator per token: k1, k2 or k3."""
    loss_agg: str = "seq-mean-token-mean"
    """`seq-mean-token-mean` (GRPO), `token-mean` (DAPO), `seq-mean-token-sum-norm` (Dr. GRPO)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    ratio_level: str = "token"
    """Importance ratio per `token` (GRPO) or per `sequence` (GSPO: length-normalised)."""
    mask_truncated: bool = False
    """DAPO: leave completions cut at max_new_tokens out of the loss."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: over the last N tokens before max_new_tokens the reward drops
    linearly by up to overlong_penalty (0: off)."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: the largest penalty, reached at max_new_tokens."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and sample more prompts until
    the batch is full, or until max_sampling_rounds; the drops are counted."""
    max_sampling_rounds: int = 3
    """Generation rounds per step at most, with dynamic_sampling."""
    is_cap: float = 2.0
    """Truncated importance sampling: each token's loss is weighted by
    min(pi_old / pi_sampler, is_cap), correcting for the sampler's weights being older (async
    mode) or numerically different (vLLM vs the learner). 0: off."""
    max_staleness: int = 1
    """trainer.mode=async: a group made by weights more than this many versions older than the
    learner's is dropped (counted in `dropped_stale`) and its prompt generated again."""


@dataclass
class WarmupConfig:
    steps: int = 270
    """Supervised warm-up steps on the learner before GRPO (0 skips it), stopped early on purpose:
    seed 0 of the built-in task gives 61% held-out accuracy at 270 steps (23% at 250)."""
    target_accuracy: float = 0.0
    """If above 0, stop the warm-up once greedy accuracy on a probe of training problems reaches
    it, checking every `check_every` steps (at most `steps`). The supervised curve is steep and
    seed-dependent (seed 1: 1% at 270 steps), so other seeds or tasks want this (measured)."""
    check_every: int = 10
    """Warm-up steps between two probes."""
    probe_size: int = 64
    """Training problems in the probe (the held-out set stays unseen until after the warm-up)."""
    batch_size: int = 64
    """Examples per warm-up step, over all learner ranks."""
    lr: float = 3e-3
    """Warm-up learning rate."""


@dataclass
class RolloutConfig:
    num_workers: int = 2
    """vLLM generation actors."""
    num_cpus_per_worker: float = 0.5
    """Ray CPUs reserved per generation actor."""
    num_gpus_per_worker: float = 0.0
    """Ray GPUs per generation actor: 0 on CPUs; on GPU clusters tensor_parallel_size (the
    engine's TP ranks run as processes inside the actor, on the actor's GPUs)."""
    tensor_parallel_size: int = 1
    """GPUs one vLLM engine is split over; each TP rank joins the weight-sync group."""
    dtype: str = "auto"
    """dtype inside vLLM, and on the wire of the weight sync. `auto`: float32 on CPUs (faster
    than bfloat16 on vLLM's CPU build for the tiny model), bfloat16 when the workers have GPUs."""
    enforce_eager: Optional[bool] = None
    """vLLM without CUDA graphs. None: eager on CPUs, CUDA graphs on GPUs."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (evaluation is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    stop_token_ids: List[int] = field(default_factory=list)
    """Token ids that end a completion, besides the tokenizer's EOS, the model's
    generation_config.json list and the chat format's end-of-turn token (all added at start)."""
    stop: List[str] = field(default_factory=list)
    """Strings that end a completion (besides EOS), e.g. ["</answer>"]."""
    include_stop_str: bool = True
    """Keep the stop string at the end of the completion (the format verifier wants to see it)."""
    chunks_per_worker: int = 4
    """The batch is cut into about num_workers * chunks_per_worker chunks of prompts, each handed
    to whichever worker is free; more chunks even out the finish, fewer batch better."""
    max_new_tokens: int = 32
    """Longest completion in tokens."""
    max_model_len: int = 128
    """vLLM's context length."""
    kv_cache_gib: float = 1.0
    """CPU only: KV cache size per engine, in GiB (fractions allowed; the tests use 0.25)."""
    gpu_memory_utilization: float = 0.85
    """GPU only: share of its GPU the engine may take (each engine has GPUs of its own)."""


@dataclass
class LearnerConfig:
    num_ranks: int = 2
    """Data-parallel DeepSpeed ranks, one Ray actor each."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (0-3)."""
    lr: float = 7e-4
    """GRPO learning rate (the default suits the built-in model; how it was chosen: the README's
    "The built-in job")."""
    lr_schedule: str = "linear"
    """`linear` decays lr to lr * min_lr_ratio at the last GRPO step; `constant` keeps it."""
    min_lr_ratio: float = 0.1
    """Where the linear schedule ends, as a fraction of lr."""
    optimizer: str = "adamw"
    """`adamw`, or `sgd` (plain, no momentum: the update is linear in the gradient, which is
    what the learner-equivalence tests compare; rarely what a run wants)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    max_tokens_per_microbatch: int = 0
    """Cut each minibatch into micro-batches of at most this many (padded) tokens and accumulate
    their gradients before the optimizer step; 0: one micro-batch (no accumulation)."""
    minibatches: int = 2
    """Optimizer steps per pass over a batch of rollouts; the later ones are off-policy, which
    is what the PPO clip is for."""
    num_cpus_per_rank: float = 0.25
    """Ray CPUs reserved per learner rank."""
    num_gpus_per_rank: float = 0.0
    """Ray GPUs per learner rank (1 on GPU clusters)."""
    backend: str = "auto"
    """torch.distributed backend: `auto` is nccl with GPUs, gloo without."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Any DeepSpeed setting, merged over the generated config (e.g.
    +learner.deepspeed.zero_optimization.offload_optimizer.device=cpu for ZeRO-Offload)."""


@dataclass
class RewardConfig:
    num_workers: int = 2
    """Verifier pool actors."""
    num_cpus_per_worker: float = 0.25
    """Ray CPUs reserved per verifier actor."""
    verifiers: List[str] = field(default_factory=lambda: ["math", "format"])
    """Verifiers that score each completion."""
    weights: Dict[str, float] = field(default_factory=lambda: {"math": 1.0, "format": 0.1})
    """Weight of each verifier in the reward."""
    custom: Dict[str, str] = field(default_factory=dict)
    """Your own verifiers: name -> `module:function` (e.g. +reward.custom.brevity=my_rewards:brevity)."""
    timeout_s: float = 5.0
    """Hard wall-clock limit of one verifier call on one completion (the process is killed)."""
    format_pattern: Optional[str] = None
    """format: a regex the whole completion must match, instead of the R1 layout."""
    language: str = "latin"
    """language: expected script (latin, han, cyrillic, ...) or code (en, zh, ru, ...); a row's
    `language` field wins."""
    length_budget: int = 1024
    """length: characters allowed before the penalty starts (it reaches -1 at twice this)."""
    sandbox_memory_mb: int = 1024
    """code: address-space limit of the sandboxed program."""
    sandbox_max_file_mb: int = 16
    """code: largest file the program may write."""
    sandbox_max_processes: int = 64
    """code: processes the sandbox may run at once."""


@dataclass
class SyncConfig:
    bucket_mb: int = 64
    """Size of the flat buckets that learner rank 0 broadcasts to the generation actors."""
    timeout_s: float = 300.0
    """A weight sync that takes longer fails with an error instead of hanging."""


@dataclass
class TrainerConfig:
    max_steps: int = 100
    """GRPO steps (one batch of rollouts, learner.minibatches updates, one weight push each)."""
    mode: str = "sync"
    """`sync`: generate, score, train, push, in turn (on-policy). `async`: the next batch is
    generated and scored while the learner trains on this one (off-policy by up to
    algo.max_staleness versions, corrected by algo.is_cap)."""
    async_lookahead: int = 1
    """trainer.mode=async: batches generated ahead of the one being trained (samples are then up
    to this many versions old, before algo.max_staleness drops any)."""
    prompts_per_step: int = 64
    """B: prompts per GRPO step; each gets group_size completions."""
    output_dir: str = "runs"
    """Parent folder of every run's files."""
    run_name: Optional[str] = None
    """Folder name of this run under output_dir (default: grpo-<date>-<time>)."""
    seed: int = 0
    """Seeds data generation, sampling and initialisation."""
    eval_every: int = 20
    """Greedy held-out accuracy every N steps, as `heldout_accuracy` (0: only before and after GRPO)."""
    progress: bool = True
    """Show the terminal progress bar."""
    save_every: int = 0
    """Write a checkpoint every N GRPO steps and at the last one (0: never)."""
    keep_checkpoints: int = 2
    """Newest complete checkpoints kept (0: all)."""
    resume: Optional[str] = None
    """`auto`: continue trainer.run_name from its newest complete checkpoint (start fresh if it
    has none); a checkpoint folder: continue from that one; None: a fresh run."""


@dataclass
class EvalConfig:
    n: int = 0
    """Samples per evaluation prompt at eval.temperature, for pass@1 (mean over samples), pass@k
    and maj@k; 0: greedy accuracy only (what heldout_accuracy always reports)."""
    temperature: float = 1.0
    """Sampling temperature of the eval.n samples."""
    k: List[int] = field(default_factory=list)
    """The k of pass@k and maj@k (each at most eval.n); empty: 1 and eval.n."""


@dataclass
class RoleNodes:
    rollout: Optional[str] = None
    """Custom node resource the generation actors need (e.g. `gen`: only nodes started with
    --resources='{"gen": 1}'); None: any node."""
    learner: Optional[str] = None
    """Custom node resource the learner ranks need; the same name as another role shares its nodes."""
    reward: Optional[str] = None
    """Custom node resource the verifier actors need."""


@dataclass
class RoleStrategy:
    rollout: str = "PACK"
    """Placement group strategy of the generation actors: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD."""
    learner: str = "PACK"
    """Placement group strategy of the learner ranks (PACK keeps NCCL traffic inside a node)."""
    reward: str = "SPREAD"
    """Placement group strategy of the verifier actors."""


@dataclass
class ClusterConfig:
    nodes: RoleNodes = field(default_factory=RoleNodes)
    """Which nodes each role runs on (roles naming the same resource share nodes)."""
    strategy: RoleStrategy = field(default_factory=RoleStrategy)
    """How each role's actors spread over those nodes."""
    placement_timeout_s: float = 300.0
    """Placement groups not placed within this fail the run with a message (never a silent wait)."""


@dataclass
class RayConfig:
    address: Optional[str] = None
    """Ray cluster to join; None starts a local Ray (or joins RAY_ADDRESS when set)."""
    num_cpus: Optional[int] = None
    """CPUs of a locally started Ray (None: what the machine has)."""
    num_gpus: Optional[int] = None
    """GPUs of a locally started Ray (None: what the machine has; the tests declare fake ones
    to check how roles are laid out on GPUs)."""


@dataclass
class LoggerConfig:
    backend: str = "wandb"
    """`wandb` or `none`; metrics.jsonl is always written."""
    project: str = "grpo"
    """wandb project."""
    mode: str = "offline"
    """wandb mode unless WANDB_MODE is set: offline, online or disabled."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
