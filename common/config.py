"""The one typed config schema. YAML in `conf/` only overlays it; dotted overrides win.

Each section is a dataclass that the role using it receives as is (no dicts across Ray). A
setting with a fixed set of values declares them once, with `one_of`; each section checks
its own values (`check`), and `Config.check` adds the checks that span sections. What needs the
file system or the verifier registry is checked by the driver (cluster/cli/compose.py).

Light on purpose: imports no torch, Ray or vLLM, so `grpo train --cfg` and config errors are
instant and happen before any actor starts.
"""
from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Union

from common.errors import BadInput


class ConfigError(BadInput):
    """A config that cannot run; its message is one line naming the key to change."""


def one_of(options: Sequence[Any], default: Any = None) -> Any:
    """A field whose value must be one of `options` (the first is the default unless given)."""
    return field(default=options[0] if default is None else default, metadata={"choices": tuple(options)})


def _check_choices(section: Any, name: str) -> None:
    for f in fields(section):
        options = f.metadata.get("choices")
        value = getattr(section, f.name)
        if options is not None and value not in options:
            raise ConfigError(f"{name}.{f.name} must be one of {', '.join(map(str, options))} (got '{value}')")


def at_least(key: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be at least {minimum} (got {value})")


class Freezable:
    """A config node that `freeze` makes refuse every write: a run's validated config stays what
    the user asked for, and what the run resolves is returned and put in a copy
    (cluster/loop/launch.run_config), never written into it. Lists and dicts in it stay mutable."""
    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot assign to field '{name}' of {type(self).__name__}: the config is "
                                      "read-only once a run has it; build a copy with dataclasses.replace")
        object.__setattr__(self, name, value)


def freeze(config: Any) -> Any:
    """`config` and every section in it made read-only (in place); returns it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, Freezable):
            freeze(value)
    object.__setattr__(config, "_frozen", True)
    return config


class Section(Freezable):
    """A config section: `check(name)` raises ConfigError for a value it cannot run with."""

    def check(self, name: str) -> None:
        _check_choices(self, name)


# Allowed values, declared once (the learner's maths imports them from here).
ADV_SCALES = ("group", "batch", "none")
ADV_STDS = ("sample", "population")
ADV_ESTIMATORS = ("grpo", "rloo", "gae")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
CORRECTIONS = ("tis", "mis", "icepop", "seq_mask")
DIGIT_DISTRIBUTIONS = ("uniform", "geometric")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TOOLS = ("calculator", "python")
TOOL_FORMATS = ("tag", "hermes")


@dataclass
class ModelConfig(Section):
    name: str = one_of(("tiny", "hf"))
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

    def check(self, name: str = "model") -> None:
        super().check(name)
        if self.name == "hf" and not self.path:
            raise ConfigError("model.path is required with model=hf (a local folder or a hub id)")


@dataclass
class DataConfig(Section):
    source: str = one_of(("arithmetic", "jsonl", "hf", "reasoning_gym"))
    """`arithmetic` (built-in generator), `jsonl` (local JSONL or Parquet file), `hf` (datasets library)
    or `reasoning_gym` (reasoning-gym's procedural tasks, the `gym` extra)."""
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
    """arithmetic, reasoning_gym: training problems to generate (0 = every problem not held out;
    reasoning_gym: 10000)."""
    min_digits: int = 2
    """arithmetic: fewest digits of an operand (at least 2)."""
    max_digits: int = 2
    """arithmetic: most digits of an operand."""
    digit_distribution: str = one_of(DIGIT_DISTRIBUTIONS)
    """arithmetic: how a problem's digit count is drawn from min_digits..max_digits: `uniform`
    per operand, or `geometric` for the longer operand (each digit more is digit_decay times as
    likely: most answers short, a few long, as in `data=long_tail`)."""
    digit_decay: float = 0.5
    """arithmetic, geometric digit counts: how much likelier d digits are than d + 1 (0 < decay < 1)."""
    op: str = one_of(("add", "mul"))
    """arithmetic: `add` (`a+b=`, with a scratchpad of digit sums to warm up on) or `mul`
    (`a*b=`: with rollout.tools=[calculator] the warm-up traces call the calculator; without a
    tool they are the bare answer, which a small model cannot learn for 3-4 digit operands)."""
    task: Optional[str] = None
    """reasoning_gym: the task, a reasoning-gym dataset name (e.g. `chain_sum`)."""
    tasks: Dict[str, float] = field(default_factory=dict)
    """reasoning_gym: several tasks mixed through reasoning-gym's composite, name -> weight
    (instead of `task`); metrics then get a `task_score/<name>` column each."""
    task_config: Dict[str, Any] = field(default_factory=dict)
    """reasoning_gym: the task's own config keys (e.g. `+data.task_config.max_terms=3`); with
    `tasks`, one mapping per task name."""
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

    def check(self, name: str = "data") -> None:
        super().check(name)
        if str(self.chat_template).lower() not in ("auto", "true", "false"):
            raise ConfigError(f"data.chat_template must be one of auto, true, false (got '{self.chat_template}')")
        at_least("data.heldout_size", self.heldout_size, 1)
        if self.eval_path and self.eval_split:
            raise ConfigError("data.eval_path and data.eval_split: give one evaluation set, not both")
        if self.eval_split and self.source != "hf":
            raise ConfigError("data.eval_split is a split of a `datasets` set (data=hf); for a file use data.eval_path")
        if self.source == "jsonl" and not self.path:
            raise ConfigError("data.path is required with data=jsonl (a .jsonl or .parquet file)")
        if self.source == "hf" and not (self.name or self.path):
            raise ConfigError("data.name (or data.path of a saved dataset) is required with data=hf")
        if self.source == "reasoning_gym" and not (self.task or self.tasks):
            raise ConfigError("data.task is required with data=reasoning_gym (e.g. data.task=chain_sum)")
        if self.source == "reasoning_gym" and self.task and self.tasks:
            raise ConfigError("data.task and data.tasks: name one task, or several with weights, not both")
        if self.source == "arithmetic":
            at_least("data.min_digits", self.min_digits, 2)
            at_least("data.max_digits", self.max_digits, self.min_digits)
            if self.digit_distribution == "geometric" and not 0 < self.digit_decay < 1:
                raise ConfigError(f"data.digit_decay must be between 0 and 1, both excluded (got {self.digit_decay})")


@dataclass
class AlgoConfig(Section):
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
    adv_scale: str = one_of(ADV_SCALES)
    """Advantage scaling: `group` std, `batch` std, or `none` (Dr. GRPO)."""
    adv_std: str = one_of(ADV_STDS)
    """The std that adv_scale divides by: `sample` (1/(n-1), as veRL, TRL and OpenRLHF) or
    `population` (1/n; advantages larger by sqrt(n/(n-1)): 1.069x at G=8, 1.155x at 4, 1.414x at 2)."""
    adv_estimator: str = one_of(ADV_ESTIMATORS)
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
    kl_estimator: str = one_of(KL_ESTIMATORS, "k3")
    """KL estimator per token: k1, k2 or k3."""
    loss_agg: str = one_of(LOSS_AGGS)
    """`seq-mean-token-mean` (GRPO), `token-mean` (DAPO), `seq-mean-token-sum-norm` (Dr. GRPO)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    ratio_level: str = one_of(RATIO_LEVELS)
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
    mode) or numerically different (vLLM vs the learner). 0: off. Used by correction=tis."""
    correction: str = one_of(CORRECTIONS)
    """How each token's ratio pi_old / pi_sampler enters the loss (docs/design.md, "Corrections"):
    `tis` weights it by min(ratio, is_cap); `mis` (masked IS) by the ratio inside [mis_low,
    mis_high] and leaves tokens outside out; `icepop` the same two-sided mask with icepop_low/high;
    `seq_mask` leaves out every token of a completion whose geometric-mean ratio is outside
    [seq_mask_low, seq_mask_high]. Every step logs what each would mask (masked_fraction_*)."""
    mis_low: float = 0.0
    """correction=mis: tokens whose ratio is below this leave the loss (0: no lower bound)."""
    mis_high: float = 2.0
    """correction=mis: tokens whose ratio is above this leave the loss."""
    icepop_low: float = 0.5
    """correction=icepop: lower bound of the ratio (IcePop's published 0.5)."""
    icepop_high: float = 5.0
    """correction=icepop: upper bound of the ratio (IcePop's published 5)."""
    seq_mask_low: float = 0.99
    """correction=seq_mask: lower bound of a completion's geometric-mean ratio."""
    seq_mask_high: float = 1.01
    """correction=seq_mask: upper bound of a completion's geometric-mean ratio."""
    max_staleness: int = 1
    """trainer.mode=async: a group made by weights more than this many versions older than the
    learner's is dropped (counted in `dropped_stale`) and its prompt generated again."""

    def check(self, name: str = "algo") -> None:
        super().check(name)
        at_least("algo.group_size", self.group_size, 2)
        at_least("algo.num_iterations", self.num_iterations, 1)
        for key in ("beta", "clip_low", "clip_high", "overlong_buffer", "max_staleness"):
            at_least(f"algo.{key}", getattr(self, key), 0)
        at_least("algo.max_sampling_rounds", self.max_sampling_rounds, 1)
        if self.is_cap != 0 and self.is_cap < 1:
            raise ConfigError(f"algo.is_cap must be 0 (off) or at least 1 (got {self.is_cap})")
        for kind in ("mis", "icepop", "seq_mask"):
            low, high = getattr(self, f"{kind}_low"), getattr(self, f"{kind}_high")
            if low >= high or low < 0:
                raise ConfigError(f"algo.{kind}_low={low:g}, algo.{kind}_high={high:g}: inverted bounds "
                                  "(need 0 <= low < high)")
            if not low <= 1 <= high:
                raise ConfigError(f"algo.{kind}_low={low:g}, algo.{kind}_high={high:g}: the bounds exclude 1, "
                                  "the ratio of on-policy tokens (need low <= 1 <= high)")


@dataclass
class WarmupConfig(Section):
    steps: int = 600
    """Most supervised warm-up steps on the learner before GRPO (0 skips the warm-up)."""
    target_accuracy: float = 0.5
    """Stop the warm-up once greedy accuracy on a probe of training problems reaches this,
    checked every `check_every` steps (at most `steps`): GRPO then sharpens an ability rather
    than creating one. The supervised curve is steep and its timing differs from seed to seed,
    so a probe, not a step count, decides (README, "The built-in job"). 0: exactly `steps`."""
    check_every: int = 5
    """Warm-up steps between two probes."""
    probe_size: int = 64
    """Training problems in the probe (the held-out set stays unseen until after the warm-up)."""
    batch_size: int = 64
    """Examples per warm-up step, over all learner ranks."""
    lr: float = 1e-3
    """Warm-up learning rate (AdamW; higher rates stall some seeds of the built-in task:
    bench/warmup_curves.py)."""

    def check(self, name: str = "warmup") -> None:
        super().check(name)
        at_least("warmup.check_every", self.check_every, 1)
        at_least("warmup.probe_size", self.probe_size, 1)


@dataclass
class RolloutConfig(Section):
    backend: str = one_of(("vllm",))
    """The generation backend each generation actor runs (cluster/loop/roles.py's BACKENDS)."""
    num_workers: int = 2
    """vLLM generation actors."""
    num_cpus_per_worker: float = 0.5
    """Ray CPUs reserved per generation actor."""
    num_threads: int = 0
    """torch threads per vLLM engine on CPUs (tensor_parallel_size 1); 0: set at start like
    learner.num_threads. Unused on GPUs and by tensor-parallel CPU engines (vLLM binds those)."""
    num_gpus_per_worker: float = 0.0
    """Ray GPUs per generation actor: 0 on CPUs; on GPU clusters tensor_parallel_size (the
    engine's TP ranks run as processes inside the actor, on the actor's GPUs)."""
    tensor_parallel_size: int = 1
    """GPUs one vLLM engine is split over; each TP rank joins the weight-sync group."""
    dtype: str = one_of(("auto", "float32", "bfloat16", "float16"))
    """dtype inside vLLM, and on the wire of the weight sync. `auto`: float32 on CPUs (faster
    than bfloat16 on vLLM's CPU build for the tiny model), bfloat16 when the workers have GPUs."""
    enforce_eager: Optional[bool] = None
    """vLLM without CUDA graphs. None: eager on CPUs, CUDA graphs on GPUs."""
    max_lora_rank: int = 0
    """The largest LoRA adapter each engine serves (vLLM's `max_lora_rank`: 1, 8, 16, 32, 64,
    128, 256, 320 or 512); 0: set by the driver from `learner.lora.rank` (rounded up to one of
    those) when the push sends adapters, else the engines serve none."""
    seeded_sampling: Union[str, bool] = one_of(("auto", True, False))
    """A seed of its own for each prompt's samples (from trainer.seed, the step and the prompt).
    `true`: a prompt's samples depend only on the weights and its seed, not on which engine
    draws it or what shares its batch, so a run and its resume repeat their samples (bitwise on
    CPUs; on GPUs up to their kernels' own nondeterminism). On GPUs vLLM 0.32 runs Model Runner
    V2, which hashes each request's seed with the token's position, so a seed costs only
    FlashInfer's fused top-k/top-p path (already off when processed log-probs are returned); the
    V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) draws seeded requests one by one. `false`: requests
    carry no seed and each engine's sampler is seeded once per generate call from that call's
    prompts (torch's generators for V1, numpy's, which V2 draws each request's seed from, for V2):
    samples repeat only when the same prompts reach an engine with the same weights in the same
    order and batches (a chunk that another worker takes after a restart, or that vLLM batches or
    preempts differently, samples differently). `auto`: true, except on GPU engines told to run
    the V1 runner."""
    engine_core: str = one_of(("auto", "actor", "process"))
    """Where vLLM's engine core runs. `actor`: inside the generation actor (no round trip per
    call, one import of torch and vLLM). `process`: a child process of the actor, as vLLM runs it
    by default (scheduling overlaps the GPU's work); a reaper kills it if the actor dies, so a
    restarted actor never meets an orphan holding its GPU. `auto`: `actor` on CPU engines,
    `process` on GPUs."""
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
    chunks_per_worker: int = 1
    """The batch is cut into about num_workers * chunks_per_worker chunks of prompts, each handed
    to whichever worker is free and scored as soon as it is done; more chunks even out the
    finish when completion lengths vary a lot, fewer batch better (on the built-in task one
    chunk per worker is fastest: bench/end_to_end.py)."""
    streaming: bool = False
    """trainer.mode=async: each engine keeps its batch full, taking the next prompts as its
    requests finish instead of draining a chunk, and each group is scored as it ends; a step
    takes its prompts' groups in the order they were issued (bench/long_tail.py). A weight push
    waits for the engines' running requests unless rollout.partial."""
    partial: bool = False
    """rollout.streaming: a weight push reaches each engine between two of its steps; running
    requests keep their KV cache and go on with the new weights, and each sample records the
    versions of its spans (the oldest is its policy_version, bounded by algo.max_staleness)."""
    stream_steps: int = 16
    """rollout.streaming: engine steps per streaming call at most (a push waits for one call)."""
    stream_groups: int = 0
    """rollout.streaming: prompt groups each engine carries at once; 0: as many as its batch
    holds (vLLM's max_num_seqs / algo.group_size)."""
    max_new_tokens: int = 32
    """Longest completion in tokens."""
    min_new_tokens: int = 0
    """Single-turn training rollouts: tokens sampled before EOS or a stop may end a completion
    (vLLM's min_tokens; 0: none). Greedy evaluation and tool episodes ignore it."""
    max_model_len: int = 128
    """vLLM's context length."""
    kv_cache_gib: float = 1.0
    """CPU only: KV cache size per engine, in GiB (fractions allowed; the tests use 0.25)."""
    gpu_memory_utilization: float = 0.85
    """GPU only: share of its GPU the engine may take (each engine has GPUs of its own)."""
    tools: List[str] = field(default_factory=list)
    """Tools the model may call between turns: `calculator` (exact arithmetic), `python` (runs
    in the code verifier's sandbox). Any tool makes each sample a multi-turn episode; empty:
    one completion per sample."""
    custom_tools: Dict[str, str] = field(default_factory=dict)
    """Your own tools: name -> `module:function` (e.g. +rollout.custom_tools.search=my_tools:search),
    called with the call's arguments, returning text."""
    tool_format: str = one_of(TOOL_FORMATS)
    """`tag`: `<tool>NAME: ARGS</tool>` answered by `<result>...</result>` (base models, the built-in
    one); `hermes`: `<tool_call>{"name", "arguments"}</tool_call>` answered in the chat
    template's `tool` role (Qwen2.5 and other instruct models)."""
    max_turns: int = 4
    """Model turns per episode at most (a call on the last turn goes unanswered)."""
    max_episode_tokens: int = 0
    """Tokens of one episode after its prompt, model and tool results together (0:
    max_new_tokens * max_turns); always within max_model_len."""
    tool_timeout_s: float = 5.0
    """Hard limit of one tool call; a call past it returns an error to the model (counted)."""
    tool_max_output_chars: int = 256
    """A tool's result is cut to this many characters before the model reads it."""
    agent: Optional[str] = None
    """Your own agent, `module:function`, called once per sample as `function(client, row, index)`
    with an OpenAI client pointed at its own session of the generation worker's endpoint
    (`async def`: `openai.AsyncOpenAI`, `def`: `openai.OpenAI`); it returns the final answer text
    or None. Each session is trained on exactly the tokens the sampler produced
    (docs: tools and agents). Imported from the working directory too."""
    agent_concurrency: int = 8
    """Agent episodes running at once per generation worker: a `def` agent's each in a process
    of its own, an `async def` agent's `agent_episodes_per_process` to a process."""
    agent_episodes_per_process: int = 8
    """Episodes of an `async def` agent that share one process's event loop (a `def` agent runs
    one per process). Fewer processes for the same concurrency: less memory and a faster first
    step (bench/agent_throughput.py). An episode past the time limit is
    cancelled; one that blocks the event loop instead stalls the process's other episodes, and
    the process is stopped with all of them."""
    agent_timeout_s: float = 60.0
    """Wall-clock limit of one agent's episode, from the moment its process is ready (the agent's
    module loaded); past it the episode ends (a `def` agent's process is killed) and is scored 0
    (counted as `agent_timeouts`)."""
    endpoint_host: str = "127.0.0.1"
    """Address the agents' endpoint listens on: loopback (agents run beside the engine), or the
    node's address for agents elsewhere."""
    endpoint_max_request_kb: int = 1024
    """A request body over this size is answered 413."""

    @property
    def episodes(self) -> bool:
        """Samples are multi-turn episodes with tools."""
        return bool(self.tools or self.custom_tools)

    @property
    def multi_turn(self) -> bool:
        """Samples span several model turns (tool episodes or agent sessions)."""
        return self.episodes or self.agent is not None

    @property
    def completion_budget(self) -> int:
        """The most tokens a sample has after its prompt (the learner's max completion length)."""
        if not self.multi_turn:
            return self.max_new_tokens
        return min(self.max_episode_tokens or self.max_new_tokens * self.max_turns, self.max_model_len - 1)

    def check(self, name: str = "rollout") -> None:
        super().check(name)
        for tool in self.tools:
            if tool not in TOOLS:
                raise ConfigError(f"rollout.tools: unknown tool '{tool}'; built in: {', '.join(TOOLS)} "
                                  "(your own: +rollout.custom_tools.NAME=module:function)")
        for tool in self.custom_tools:
            if tool in TOOLS:
                raise ConfigError(f"rollout.custom_tools.{tool}: '{tool}' is a built-in tool; name yours otherwise")
        at_least("rollout.max_turns", self.max_turns, 1)
        at_least("rollout.num_threads", self.num_threads, 0)
        at_least("rollout.min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"rollout.min_new_tokens={self.min_new_tokens} exceeds rollout.max_new_tokens="
                              f"{self.max_new_tokens}")
        at_least("rollout.max_episode_tokens", self.max_episode_tokens, 0)
        at_least("rollout.tool_max_output_chars", self.tool_max_output_chars, 1)
        at_least("rollout.agent_concurrency", self.agent_concurrency, 1)
        at_least("rollout.agent_episodes_per_process", self.agent_episodes_per_process, 1)
        at_least("rollout.endpoint_max_request_kb", self.endpoint_max_request_kb, 1)
        if self.agent_timeout_s <= 0:
            raise ConfigError(f"rollout.agent_timeout_s must be above 0 (got {self.agent_timeout_s})")
        if self.agent is not None and self.episodes:
            raise ConfigError("rollout.agent with rollout.tools: an agent runs its own tools; set one or the other")
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"rollout.tool_timeout_s must be above 0 (got {self.tool_timeout_s})")
        for key in ("num_workers", "max_new_tokens", "chunks_per_worker", "tensor_parallel_size"):
            at_least(f"rollout.{key}", getattr(self, key), 1)
        at_least("rollout.stream_steps", self.stream_steps, 1)
        at_least("rollout.stream_groups", self.stream_groups, 0)
        if self.partial and not self.streaming:
            raise ConfigError("rollout.partial=true needs rollout.streaming=true (and trainer.mode=async)")
        at_least("rollout.top_k", self.top_k, 0)
        gpus, tp = self.num_gpus_per_worker, self.tensor_parallel_size
        if gpus and gpus != tp:
            raise ConfigError(f"rollout.num_gpus_per_worker={gpus:g} with rollout.tensor_parallel_size={tp}: an "
                              "engine takes one whole GPU per tensor-parallel rank (its ranks run inside the "
                              "actor, on its GPUs); make them equal")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be above 0 for sampling (got {self.temperature}); "
                              "evaluation is greedy anyway")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1] (got {self.top_p})")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"rollout.kv_cache_gib must be above 0 (got {self.kv_cache_gib})")
        if any(not s for s in self.stop):
            raise ConfigError("rollout.stop: an empty stop string would end every completion at once")
        if self.max_new_tokens >= self.max_model_len:
            raise ConfigError(f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for the prompt "
                              f"in rollout.max_model_len={self.max_model_len}")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM engine can be sized for (its `max_lora_rank`)."""


@dataclass
class LoraConfig(Section):
    rank: int = 0
    """LoRA rank r of every adapted projection; 0: no LoRA, the whole model trains. With r > 0
    the supervised warm-up still trains the whole model, then GRPO trains only the adapters on
    that base (only they have optimizer state; without warm-up the whole model's optimizer is
    never built) and the frozen reference is the base with the adapters switched off: no second
    copy of the model."""
    alpha: float = 16.0
    """LoRA's scale numerator: the adapter's update B A is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: Optional[List[str]] = None
    """Names (or name suffixes, peft's matching) of the linear layers that get adapters; None:
    every linear projection of the transformer blocks (peft's `all-linear`, not the output head)."""
    push: str = one_of(("adapter", "merged"))
    """What the weight push sends each step: `adapter`, only the adapters (2 r (d_in + d_out)
    numbers per projection), served by every vLLM engine as a new LoRA version; `merged`, the
    full weights with the adapters merged in (for engines that cannot serve adapters)."""

    def check(self, name: str = "learner.lora") -> None:
        super().check(name)
        at_least(f"{name}.rank", self.rank, 0)
        if self.rank and self.alpha <= 0:
            raise ConfigError(f"{name}.alpha must be positive (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{name}.dropout must be in [0, 1) (got {self.dropout})")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError(f"{name}.target_modules is empty: name at least one module, or leave it unset")


@dataclass
class LearnerConfig(Section):
    num_ranks: int = 2
    """Data-parallel DeepSpeed ranks, one Ray actor each."""
    zero_stage: int = one_of((0, 1, 2, 3), 2)
    """DeepSpeed ZeRO stage (0-3)."""
    lr: float = 7e-4
    """GRPO learning rate (the default suits the built-in model; how it was chosen: the README's
    "The built-in job")."""
    lr_schedule: str = one_of(("linear", "constant"))
    """`linear` decays lr to lr * min_lr_ratio at the last GRPO step; `constant` keeps it."""
    min_lr_ratio: float = 0.1
    """Where the linear schedule ends, as a fraction of lr."""
    optimizer: str = one_of(("adamw", "sgd"))
    """`adamw`, or `sgd` (plain, no momentum: the update is linear in the gradient, which is
    what the learner-equivalence tests compare; rarely what a run wants)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    max_tokens_per_microbatch: int = 4096
    """Cut each minibatch into micro-batches of at most this many (padded) tokens, rows sorted
    by length so that each is padded only to its own longest row, and accumulate their
    gradients before the optimizer step; 0: the whole minibatch in one, padded to the batch's
    longest row. Bounds the learner's activation memory; raise it on large GPUs."""
    pack_sequences: bool = False
    """Run each micro-batch as one packed row (its rows' tokens end to end, position ids
    restarting per row, no attention mask: transformers builds the block-causal mask from them)
    and cut micro-batches by real tokens, so no forward works on padding; the same loss and
    gradient as the padded path. For long-tailed lengths, where the step's `padded_fraction`
    stays high after sorting by length (docs/learner.md, "Packing"). The model's forward must
    take position_ids; PPO's value model stays padded."""
    minibatches: int = 2
    """Optimizer steps per pass over a batch of rollouts; the later ones are off-policy, which
    is what the PPO clip is for."""
    num_cpus_per_rank: float = 0.25
    """Ray CPUs reserved per learner rank."""
    num_threads: int = 0
    """torch threads per learner rank on CPUs; 0: set at start from the CPUs of a node (sync
    mode: the phases take turns, so the ranks share all of them; async mode: ranks and engines
    run at once and share them without oversubscription). Printed at start. Unused on GPUs."""
    num_gpus_per_rank: float = 0.0
    """Ray GPUs per learner rank (1 on GPU clusters)."""
    backend: str = one_of(("auto", "gloo", "nccl"))
    """torch.distributed backend: `auto` is nccl with GPUs, gloo without."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Any DeepSpeed setting, merged over the generated config (e.g.
    +learner.deepspeed.zero_optimization.offload_optimizer.device=cpu for ZeRO-Offload)."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them from the forward (the model's own `gradient_checkpointing_enable`, non-reentrant), for
    the policy and PPO's value model; the model's KV cache is off while it trains. It trades
    about one more forward per micro-batch for activation memory that no longer grows with the
    layers. None (the default): on when the learner ranks have GPUs, where activations are
    what runs out of memory at long completions; off on CPUs, where the built-in model's
    activations are small beside its weights and optimizer and the extra forward costs step
    time (the measured trade: the report of bench/memory_scale.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (peft) for GRPO, and what the weight push sends with them."""
    return_freed_memory: Optional[bool] = None
    """Start the learner ranks with glibc set to return freed blocks of 1 MiB and more to the
    system at once, on transparent huge pages (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
    GLIBC_TUNABLES; one already set in the environment wins). ZeRO-3 gathers and frees every
    block's parameters twice a step, and glibc's default keeps what is freed: a CPU rank's peak
    grows step after step. None (the default): on for ZeRO-3 ranks without GPUs; off otherwise
    (ZeRO-2 keeps its blocks, and gains little). The measured trade: the report of
    bench/memory_scale.py."""

    def check(self, name: str = "learner") -> None:
        super().check(name)
        self.lora.check(f"{name}.lora")
        at_least("learner.num_ranks", self.num_ranks, 1)
        at_least("learner.minibatches", self.minibatches, 1)
        at_least("learner.num_threads", self.num_threads, 0)
        if self.num_gpus_per_rank not in (0, 1):
            raise ConfigError(f"learner.num_gpus_per_rank={self.num_gpus_per_rank:g}: a learner rank uses one "
                              "whole GPU (1) or none (0); NCCL refuses two ranks on one GPU")
        self._check_offload()

    def _check_offload(self) -> None:
        """ZeRO-Offload (`learner.deepspeed.zero_optimization.offload_optimizer`): learner/engines.py
        steps it with DeepSpeed's CPU Adam, which exists for these devices and AdamW only."""
        zero = dict(dict(self.deepspeed or {}).get("zero_optimization") or {})
        offload = zero.get("offload_optimizer")
        if offload is None:
            return
        device = dict(offload).get("device", "none") if isinstance(offload, dict) else offload
        key = "learner.deepspeed.zero_optimization.offload_optimizer.device"
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{key}={device!r}: must be cpu or nvme (or none)")
        if device == "none":
            return
        if self.optimizer != "adamw":
            raise ConfigError(f"{key}={device}: the offloaded optimizer is DeepSpeed's CPU Adam; "
                              f"learner.optimizer={self.optimizer} has no host version (use adamw)")
        if int(zero.get("stage", self.zero_stage)) < 1:
            raise ConfigError(f"{key}={device}: ZeRO-Offload needs ZeRO stage 1, 2 or 3")
        if device == "nvme" and not dict(offload).get("nvme_path"):
            raise ConfigError(f"{key}=nvme needs learner.deepspeed.zero_optimization.offload_optimizer.nvme_path")


@dataclass
class RewardModelConfig(Section):
    path: Optional[str] = None
    """reward_model: a local Hugging Face sequence-classification folder with one logit (its
    config sets `pad_token_id`); the `reward_model` verifier scores prompt + completion with it."""
    num_workers: int = 1
    """reward_model: Ray actors that serve the model (a pool of its own beside the verifier pool)."""
    num_cpus_per_worker: float = 0.0
    """reward_model: Ray CPUs reserved per actor, outside the roles' placement groups (0: none, so
    that the default roles, which reserve every CPU of a 2-core machine, leave it room)."""
    num_gpus_per_worker: float = 0.0
    """reward_model: Ray GPUs per actor (0: the model runs on CPU)."""
    batch_size: int = 64
    """reward_model: completions per forward pass."""
    normalize: str = one_of(("none", "sigmoid"))
    """reward_model: the score is the logit (`none`) or its sigmoid, in (0, 1) like the rule verifiers."""
    timeout_s: float = 60.0
    """reward_model: a batch not scored within this scores 0 and counts as timed out."""

    def check(self, name: str = "reward.model") -> None:
        super().check(name)
        at_least(f"{name}.num_workers", self.num_workers, 1)
        at_least(f"{name}.batch_size", self.batch_size, 1)
        if self.timeout_s <= 0:
            raise ConfigError(f"{name}.timeout_s must be positive (got {self.timeout_s})")


@dataclass
class JudgeConfig(Section):
    path: Optional[str] = None
    """judge: a local causal-LM folder, served by vLLM engines of the judge's own."""
    num_workers: int = 1
    """judge: vLLM engines (Ray actors) that judge."""
    num_cpus_per_worker: float = 0.0
    """judge: Ray CPUs reserved per engine, outside the roles' placement groups (0: none)."""
    num_gpus_per_worker: float = 0.0
    """judge: Ray GPUs per engine (0: vLLM's CPU build)."""
    template: str = "Question: {prompt}\nAnswer: {completion}\nReference: {answer}\nCorrect (yes or no)? "
    """judge: the judge's prompt, a format string over `{prompt}`, `{completion}` (required) and `{answer}`."""
    verdict: str = one_of(("yes_no", "number"))
    """judge: how the reply is read: `yes_no` (the first yes or no: 1 or 0) or `number` (the first
    number, divided by `max_score` and clipped to [0, 1])."""
    verdict_pattern: Optional[str] = None
    """judge: a regex whose first group is the verdict, instead of the rule's own (`\\b(yes|no)\\b`
    ignoring case, or the first number)."""
    max_score: float = 1.0
    """judge: number verdicts: the score that means fully right (e.g. 10 for a 0-10 scale)."""
    unparseable_score: float = 0.0
    """judge: the score of a reply with no verdict (counted per step as `judge_unparseable`)."""
    max_new_tokens: int = 8
    """judge: tokens of the reply (greedy)."""
    max_model_len: int = 0
    """judge: the engine's context, the rendered template plus max_new_tokens (0: the model's own
    max_position_embeddings)."""
    kv_cache_gib: float = 0.25
    """judge: each CPU engine's KV cache."""
    timeout_s: float = 120.0
    """judge: a batch not judged within this scores 0 and counts as timed out."""

    def check(self, name: str = "reward.judge") -> None:
        super().check(name)
        at_least(f"{name}.num_workers", self.num_workers, 1)
        at_least(f"{name}.max_new_tokens", self.max_new_tokens, 1)
        if self.max_score <= 0:
            raise ConfigError(f"{name}.max_score must be positive (got {self.max_score})")
        if self.timeout_s <= 0:
            raise ConfigError(f"{name}.timeout_s must be positive (got {self.timeout_s})")


@dataclass
class RewardConfig(Section):
    scorer: str = one_of(("verifiers",))
    """What scores completions in each verifier actor: the rule-based `verifiers` below
    (cluster/loop/roles.py's SCORERS)."""
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
    gym_extract: str = one_of(("answer", "whole"))
    """reasoning_gym: what the task's `score_answer` gets: `answer`, the last `<answer>` block (else
    the last `\\boxed{}`), as math extracts it; `whole`, the completion stripped. No answer scores 0."""
    gym_score_floor: float = 0.1
    """reasoning_gym: a task's score below this counts 0. Several tasks give 0.01-0.05 to any
    wrong answer, which would make an all-wrong group look informative (format noise with
    advantages of +-1) and keep it past dynamic sampling; 0 keeps every score as the task gives it."""
    sandbox_memory_mb: int = 1024
    """code: address-space limit of the sandboxed program."""
    sandbox_max_file_mb: int = 16
    """code: largest file the program may write."""
    sandbox_max_processes: int = 64
    """code: processes the sandbox may run at once."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The `reward_model` verifier's model and its pool of actors."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The `judge` verifier: an LLM judge on vLLM engines of its own."""

    def check(self, name: str = "reward") -> None:
        super().check(name)
        self.model.check(f"{name}.model")
        self.judge.check(f"{name}.judge")
        at_least("reward.num_workers", self.num_workers, 1)
        if not 0 <= self.gym_score_floor <= 1:
            raise ConfigError(f"reward.gym_score_floor must be between 0 and 1 (got {self.gym_score_floor})")


@dataclass
class SyncConfig(Section):
    bucket_mb: int = 64
    """Size of the flat buckets that learner rank 0 broadcasts to the generation actors."""
    transport: str = one_of(("auto", "broadcast", "shm"))
    """How the bytes travel. `broadcast`: over the sync group (NCCL on GPUs, gloo on CPUs).
    `shm`: learner rank 0 writes the buckets once into a shared-memory file and every engine on
    its node loads from it (CPU learners, every engine on the learner's node; the group carries
    only "bucket i is written"). `auto`: shm where it applies, else broadcast."""
    timeout_s: float = 300.0
    """A weight sync that takes longer fails with an error instead of hanging."""


@dataclass
class TrainerConfig(Section):
    max_steps: int = 50
    """GRPO steps (one batch of rollouts, learner.minibatches updates, one weight push each)."""
    mode: str = one_of(("sync", "async"))
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
    save_every: int = 10
    """Write a checkpoint every N GRPO steps and at the last one (0: never). A lost learner rank
    or a killed driver repeats at most N - 1 steps; what the saves cost is the run summary's
    `checkpoint_seconds` (docs/performance.md, "Checkpoint cost", measures it). Raise it where
    one save takes longer than half a step (a large model on fast GPUs with a slow shared file
    system)."""
    keep_checkpoints: int = 2
    """Newest complete checkpoints kept (0: all)."""
    resume: Optional[str] = None
    """`auto`: continue trainer.run_name from its newest complete checkpoint (start fresh if it
    has none); a checkpoint folder: continue from that one; None: a fresh run."""
    max_restarts: int = 3
    """Times the driver rebuilds a lost learner group by itself (new placement and ranks, the
    newest complete checkpoint reloaded, every engine re-synced) before the run stops with the
    line to resume; 0: stop at the first loss. A few, not unlimited: a rank lost again and
    again (a model that does not fit, a bad node that keeps getting picked) should stop the
    run rather than loop. With max_restarts > 0 the state after the warm-up is checkpointed
    (step 0), so a loss before the first scheduled save has something to go back to."""
    stop_grace_s: int = 600
    """Seconds between SIGTERM and SIGKILL that `grpo submit` asks Ray for (the job's
    RAY_JOB_STOP_WAIT_TIME_S; Ray's own default is 3): on SIGTERM the run ends its step, writes
    a checkpoint of it and exits 143, which needs a step's and a checkpoint's time. Other
    schedulers send SIGTERM too: give them at least this grace (Kubernetes
    terminationGracePeriodSeconds, Slurm KillWait or `--signal=TERM@SECONDS`)."""

    def check(self, name: str = "trainer") -> None:
        super().check(name)
        at_least("trainer.async_lookahead", self.async_lookahead, 1)
        at_least("trainer.max_steps", self.max_steps, 0)
        at_least("trainer.prompts_per_step", self.prompts_per_step, 1)
        at_least("trainer.save_every", self.save_every, 0)
        at_least("trainer.keep_checkpoints", self.keep_checkpoints, 0)
        at_least("trainer.max_restarts", self.max_restarts, 0)
        at_least("trainer.stop_grace_s", self.stop_grace_s, 1)
        if self.resume == "auto" and not self.run_name:
            raise ConfigError("trainer.resume=auto needs trainer.run_name: the name of the run to continue")


@dataclass
class EvalConfig(Section):
    n: int = 0
    """Samples per evaluation prompt at eval.temperature, for pass@1 (mean over samples), pass@k
    and maj@k; 0: greedy accuracy only (what heldout_accuracy always reports)."""
    temperature: float = 1.0
    """Sampling temperature of the eval.n samples."""
    k: List[int] = field(default_factory=list)
    """The k of pass@k and maj@k (each at most eval.n); empty: 1 and eval.n."""

    def check(self, name: str = "eval") -> None:
        super().check(name)
        at_least("eval.n", self.n, 0)
        for k in self.k:
            if not 1 <= k <= max(self.n, 1):
                raise ConfigError(f"eval.k={list(self.k)}: each k must be between 1 and eval.n={self.n}")
        if self.n and self.temperature <= 0:
            raise ConfigError(f"eval.temperature must be > 0 for sampled evaluation (got {self.temperature})")


@dataclass
class RoleNodes(Section):
    rollout: Optional[str] = None
    """Custom node resource the generation actors need (e.g. `gen`: only nodes started with
    --resources='{"gen": 1}'); None: any node."""
    learner: Optional[str] = None
    """Custom node resource the learner ranks need; the same name as another role shares its nodes."""
    reward: Optional[str] = None
    """Custom node resource the verifier actors need."""


@dataclass
class RoleStrategy(Section):
    rollout: str = one_of(PLACEMENT_STRATEGIES)
    """Placement group strategy of the generation actors: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD."""
    learner: str = one_of(PLACEMENT_STRATEGIES)
    """Placement group strategy of the learner ranks (PACK keeps NCCL traffic inside a node)."""
    reward: str = one_of(PLACEMENT_STRATEGIES, "SPREAD")
    """Placement group strategy of the verifier actors."""


@dataclass
class ClusterConfig(Section):
    nodes: RoleNodes = field(default_factory=RoleNodes)
    """Which nodes each role runs on (roles naming the same resource share nodes)."""
    strategy: RoleStrategy = field(default_factory=RoleStrategy)
    """How each role's actors spread over those nodes."""
    placement_timeout_s: float = 300.0
    """Placement groups not placed within this fail the run with a message (never a silent wait)."""

    def check(self, name: str = "cluster") -> None:
        super().check(name)
        self.strategy.check(f"{name}.strategy")


@dataclass
class RayConfig(Section):
    address: Optional[str] = None
    """Ray cluster to join; None starts a local Ray (or joins RAY_ADDRESS when set)."""
    num_cpus: Optional[int] = None
    """CPUs of a locally started Ray (None: what the machine has)."""
    num_gpus: Optional[int] = None
    """GPUs of a locally started Ray (None: what the machine has; the tests declare fake ones
    to check how roles are laid out on GPUs)."""


LOGGERS = ("wandb", "tensorboard", "mlflow")
MLFLOW_SCHEMES = ("file", "http", "https", "databricks")


@dataclass
class LoggerConfig(Section):
    backends: List[str] = field(default_factory=lambda: ["wandb"])
    """Dashboards the metrics also go to, any of wandb, tensorboard, mlflow (`logger=none`: []);
    metrics.jsonl is always written. `logger=[wandb,tensorboard]` picks several groups."""
    project: str = "grpo"
    """wandb project and MLflow experiment."""
    mode: str = one_of(("offline", "online", "disabled"))
    """wandb mode unless WANDB_MODE is set: offline, online or disabled."""
    mlflow_tracking_uri: Optional[str] = None
    """mlflow: the tracking server or store (http(s)://, file:, databricks); None: a file store in
    the run folder (`mlruns/`)."""
    timeout_s: float = 30.0
    """The longest a dashboard's request may take, and how long the run's end waits for each
    dashboard to finish; one that fails or hangs is warned about once and left behind."""

    def check(self, name: str = "logger") -> None:
        super().check(name)
        for backend in self.backends:
            if backend not in LOGGERS:
                raise ConfigError(f"logger.backends: unknown logger '{backend}' (one of {', '.join(LOGGERS)}; "
                                  "none: logger=none)")
        if self.mlflow_tracking_uri is not None:
            problem = _uri_problem(self.mlflow_tracking_uri)
            if problem:
                raise ConfigError(f"logger.mlflow_tracking_uri='{self.mlflow_tracking_uri}': {problem}")
        if self.timeout_s <= 0:
            raise ConfigError(f"logger.timeout_s must be positive (got {self.timeout_s})")


def _uri_problem(uri: str) -> Optional[str]:
    """Why MLflow could not use `uri` as a tracking URI (None if it can)."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(uri)
        parsed.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError as exc:
        return f"not a URI ({exc})"
    if parsed.scheme not in MLFLOW_SCHEMES:
        return (f"the scheme '{parsed.scheme}' is not one MLflow's client here can use "
                f"({', '.join(s + ':' for s in MLFLOW_SCHEMES)})" if parsed.scheme else
                "no scheme: use file:///absolute/path for a local store, or http(s)://host:port")
    if parsed.scheme in ("http", "https") and not parsed.hostname:
        return "no host (e.g. http://mlflow.example:5000)"
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        return "a file: URI names a local folder (file:///absolute/path)"
    if any(ch.isspace() for ch in uri):
        return "it contains white space"
    return None


@dataclass
class Config(Freezable):
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

    def check(self) -> None:
        """Every section's own checks, then those that span sections."""
        for f in fields(self):
            getattr(self, f.name).check(f.name)
        algo, rollout, learner, trainer = self.algo, self.rollout, self.learner, self.trainer
        if algo.overlong_buffer > rollout.max_new_tokens:
            raise ConfigError(f"algo.overlong_buffer={algo.overlong_buffer} exceeds "
                              f"rollout.max_new_tokens={rollout.max_new_tokens}")
        # Groups are the unit that learner ranks split: advantages need a whole group on one rank.
        groups_per_rank, rest = divmod(trainer.prompts_per_step, learner.num_ranks)
        if rest:
            raise ConfigError(f"trainer.prompts_per_step={trainer.prompts_per_step} cannot be split over "
                              f"learner.num_ranks={learner.num_ranks}: make it a multiple of the ranks")
        if groups_per_rank * algo.group_size < learner.minibatches:
            raise ConfigError(f"learner.minibatches={learner.minibatches} exceeds the "
                              f"{groups_per_rank * algo.group_size} completions each learner rank gets per step")
        _check_lora(self)
        _check_streaming(self)
        if self.warmup.steps and self.warmup.batch_size % learner.num_ranks:
            raise ConfigError(f"warmup.batch_size={self.warmup.batch_size} cannot be split over "
                              f"learner.num_ranks={learner.num_ranks}")


def _check_streaming(cfg: "Config") -> None:
    """Streaming and partial rollouts against the rest of the run."""
    rollout = cfg.rollout
    if rollout.streaming and cfg.trainer.mode != "async":
        raise ConfigError("rollout.streaming=true needs trainer.mode=async (sync mode generates each step's "
                          "batch with the learner's weights, on-policy)")
    if not rollout.partial:
        return
    if cfg.algo.max_staleness == 0:
        raise ConfigError("rollout.partial=true with algo.max_staleness=0: a sample that spans a push is always "
                          "a version old; allow at least 1")
    if cfg.learner.lora.rank and cfg.learner.lora.push == "adapter":
        raise ConfigError("rollout.partial=true with learner.lora.push=adapter: an engine serves one adapter "
                          "version at a time, so running requests cannot move to a new one; use "
                          "learner.lora.push=merged or rollout.partial=false")


def _check_lora(cfg: "Config") -> None:
    """LoRA against the rest: what the engines can serve, and what the learner can train."""
    lora, rollout = cfg.learner.lora, cfg.rollout
    if rollout.max_lora_rank and rollout.max_lora_rank not in LORA_RANKS:
        raise ConfigError(f"rollout.max_lora_rank={rollout.max_lora_rank}: vLLM serves adapters of rank "
                          f"{', '.join(map(str, LORA_RANKS))} at most")
    if not lora.rank:
        return
    if cfg.algo.adv_estimator == "gae":
        raise ConfigError("learner.lora.rank > 0 with algo.adv_estimator=gae: the critic has no LoRA; "
                          "use grpo or rloo, or learner.lora.rank=0")
    if lora.push != "adapter":
        return
    if lora.rank > max(rollout.max_lora_rank or LORA_RANKS[-1], 0):
        raise ConfigError(f"learner.lora.rank={lora.rank} exceeds what the engines serve "
                          f"(rollout.max_lora_rank={rollout.max_lora_rank or LORA_RANKS[-1]}); "
                          "use learner.lora.push=merged")
    if rollout.tools or rollout.agent is not None:
        raise ConfigError("learner.lora.push=adapter serves single-turn generation only; with rollout.tools "
                          "or rollout.agent use learner.lora.push=merged")

