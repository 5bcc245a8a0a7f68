"""Helpers that several test modules share (instead of importing each other)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import ray

from common.messages import GenerationRequest

GRPO = str(Path(sys.executable).parent / "grpo")


def run(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """A command as a user types it, its output captured."""
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def small_overrides(model_cache: str, tmp_dir: str):
    """A run small enough for tests, on the same code path as the default job."""
    return [
        f"model.cache_dir={model_cache}",
        f"trainer.output_dir={tmp_dir}",
        "trainer.prompts_per_step=8",
        "trainer.progress=false",
        "algo.group_size=4",
        "data.heldout_size=16",
        "warmup.steps=20",
        "warmup.check_every=10",
        "warmup.target_accuracy=0.99",  # exercises the probe path: two probes, two pushes
        "logger=none",
        # Two test workers each hold engines of their own (and some tests start more): the
        # default 1 GiB of KV cache each would fill this machine's memory.
        "rollout.kv_cache_gib=0.25",
    ]


def varied_groups(vocab: int, group_size: int, num_groups: int = 4):
    """Prompt groups with varied lengths, rewards and finish reasons, fixed by a seed."""
    from common.prompt_group import PromptGroup

    rng = random.Random(7)
    groups = []
    for i in range(num_groups):
        completions = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for _ in range(group_size)]
        groups.append(PromptGroup(
            index=i, prompt=f"q{i}", answer="0", prompt_ids=[rng.randrange(3, vocab) for _ in range(5)],
            completions=["x"] * group_size, completion_ids=completions,
            finish_reasons=[rng.choice(["stop", "length"]) for _ in range(group_size)], policy_version=0,
            rewards=[float(rng.random() < 0.5) + 0.1 * rng.random() for _ in range(group_size)]))
    return groups


def learned(before: float, after: float, n: int, z: float = 2.5) -> bool:
    """Did accuracy on n problems rise by more than z standard errors of the difference of two
    proportions? A machine-independent learning check: where the warm-up lands differs
    between CPUs (61.0% on one machine, 63.5% on another), the gain GRPO makes is what counts."""
    se = ((before * (1 - before) + after * (1 - after)) / n) ** 0.5
    return after - before > z * max(se, 1 / n)


def release_in_process_engine(worker) -> None:
    """Undo what a GenerationWorker built in the test process leaves in it, once its own tools
    or agents are closed: vLLM's default process group (a later test that forks this process
    would inherit it: tests/unit/test_adv_std.py) and the torch.compile switch an eager CPU
    engine turns off (rollout/worker.py no_compile), which later tests should not depend on."""
    import torch._dynamo
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    worker.__dict__.clear()
    cleanup_dist_env_and_memory()
    torch._dynamo.config.disable = False
    for name in ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE"):
        os.environ.pop(name, None)


PROMPTS = ["47+85=", "12+34=", "99+99=", "50+7=", "3+4="]


@contextmanager
def warmed_learner(learners, cfg, zero_stage: int):
    """A 2-rank learner whose weights differ from the engines' initial ones (3 warm-up steps),
    from the module's pool `learners` (tests/learner_pool.py). Under ZeRO-3 every parameter
    is partitioned, as a large model's would be (DeepSpeed keeps parameters under 1e5 elements
    whole by default: every one of the tiny model's)."""
    from data.datasets import load_problems

    learner_cfg = replace(cfg.learner, zero_stage=zero_stage, num_ranks=2,
                          deepspeed={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    with learners.learner(cfg.model.path, learner_cfg, cfg.algo, cfg.rollout.max_new_tokens, 0) as learner:
        train_set = load_problems(cfg.data, 0).train
        learner.load_warmup(ray.put([(p.prompt, p.solution) for p in train_set]))
        learner.warmup(3, 16, 3e-3, 0)
        yield learner


def seeded(rows, seeds) -> list:
    """Generation requests of (index, prompt, answer, fields) rows, one seed each."""
    return [GenerationRequest(index, prompt, answer, fields, seed)
            for (index, prompt, answer, fields), seed in zip(rows, seeds)]


def greedy_ids(worker, prompts=PROMPTS):
    """A generation worker's greedy completion ids for `prompts`."""
    batch = seeded([(i, p, "", {}) for i, p in enumerate(prompts)], [0] * len(prompts))
    out = ray.get(worker.generate.remote(*batch, n=1, greedy=True))
    return [g.completion_ids for g in out[:-1]]


# ---- probes of a generation worker: run in its actor through Ray's `__ray_call__` ------------
def prompt_logprobs(worker, prompts) -> list:
    """log p(token_t | tokens_<t) of each prompt's tokens after the first, under the adapter the
    worker serves (for exactness tests)."""
    from vllm import SamplingParams

    outputs = worker.llm.generate(list(prompts), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                  use_tqdm=False, lora_request=worker.lora_request)
    return [[float(step[token].logprob) for token, step in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
            for o in outputs]


def weights_checksum(worker) -> list:
    """Per tensor-parallel rank, the sum of each parameter (its shard) by name."""
    return worker.llm.collective_rpc("weights_checksum")


def serve_adapter(worker, folder: str) -> None:
    """Serve the peft adapter saved in `folder` from the next call on (a fresh engine given a
    saved adapter; `rollout.max_lora_rank` must hold it)."""
    from vllm.lora.request import LoRARequest

    worker._lora_pushes += 1
    worker.lora_request = LoRARequest(f"saved-{worker._lora_pushes}", worker._lora_pushes, folder)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes run in the actors


def engine_state(worker, prompts=PROMPTS):
    """What must match between two engines holding the same weights: greedy outputs, prompt
    log-probs, and every tensor-parallel rank's parameter sums."""
    return (greedy_ids(worker, prompts), ray.get(worker.__ray_call__.remote(prompt_logprobs, prompts)),
            ray.get(worker.__ray_call__.remote(weights_checksum)))


def compiled_graphs():
    """A function that says how many graphs torch.compile has compiled in the process it runs in:
    an engine's actor (`actor.__ray_call__`, which passes the actor) or a tensor-parallel rank
    (vLLM's `collective_rpc`, which passes the rank's worker). Nested, so that it is pickled by
    value: neither process can import this module."""
    def count(_owner=None) -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    return count


class EngineTap:
    """A vLLM engine with a record of each request's prompt ids and, once it finished, the ids of
    each of its samples (a tap, not a mock: every call goes to the real engine)."""

    def __init__(self, engine):
        self.engine, self.prompts, self.sampled = engine, {}, {}

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = list(prompt["prompt_token_ids"])
        return self.engine.add_request(request_id, prompt, params)

    def step(self):
        outputs = self.engine.step()
        for out in outputs:
            if out.finished:
                self.sampled[out.request_id] = [list(c.token_ids) for c in out.outputs]
        return outputs

    def __getattr__(self, name):
        return getattr(self.engine, name)


def copy_without_chat_template(model_path: str, target) -> None:
    """A copy of a model folder whose tokenizer has no chat template."""
    import json
    import shutil

    shutil.copytree(model_path, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))


# Actors for tests/integration/test_dispatch.py (a worker imports them from here: tests/ is on its path).
class Silent:
    """An engine killed by Ray's memory monitor at every start never answers its ready call."""

    def ready(self):
        time.sleep(60)


class Broken:
    def __init__(self):
        raise OSError("disk full")

    def ready(self):
        return True


class EnvProbe:
    """Stands in for a LearnerRank in a LearnerGroup (tests/integration/test_learner_memory.py):
    takes a rank's arguments and keeps the environment its process started with."""

    def __init__(self, *args):
        self.env = dict(os.environ)
