"""An LLM judge as a verifier: `judge` asks a second model, served by vLLM engines of its own, whether
a completion is right, and reads a score from its reply.

The judge's prompt is `reward.judge.template` filled with `{prompt}` (as the policy saw it),
`{completion}` and `{answer}` (the gold answer); the reply is sampled greedily (temperature 0:
the same completion always gets the same verdict) and read by the verdict rule: `yes_no` (the
first "yes" or "no", any case: 1 or 0) or `number` (the first number over `max_score`, clipped
to [0, 1]); `verdict_pattern` replaces the rule's regex (its first group is the verdict). A reply
with no verdict scores `unparseable_score` and is counted (`judge_unparseable` per step).

The verdict rules are reward/verdicts.py (no Ray there: the driver checks them before any actor).
The engines are Ray actors (`JudgeWorker`) restarted by Ray when they die, the call in flight run
again on the new engine; reward/model_scorer.py sends them each verifier actor's batch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Sequence


from common.config import JudgeConfig
from reward.model_pool import ModelActorPool

__all__ = ["JudgePool", "JudgeWorker"]

"""Re-runs of one batch after its engine died (each on the restarted engine)."""
class JudgeWorker:
    """One judge engine (a vLLM `LLM` in this actor): prompts in, greedy replies out."""

    def __init__(self, settings: JudgeConfig):
        from vllm.platforms import current_platform

        self.settings = settings
        cpu = current_platform.is_cpu()
        # The engine core inside this actor on CPUs, nothing compiled (as the generation actors
        # run theirs: rollout/worker.py says why).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if cpu else "1")
        if cpu:
            os.environ["TORCH_COMPILE_DISABLE"] = "1"
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        from vllm import LLM

        path = os.path.expanduser(settings.path)
        length = settings.max_model_len or json.loads(Path(path, "config.json").read_text()).get(
            "max_position_embeddings", 8192)
        # On CPUs a prompt is prefilled whole (as the generation actors do: rollout/worker.py).
        extra = {"kv_cache_memory_bytes": int(settings.kv_cache_gib * 2**30), "enable_chunked_prefill": False,
                 "max_num_batched_tokens": max(length, 8192)} if cpu else {}
        self.llm = LLM(model=path, dtype="float32" if cpu else "bfloat16", max_model_len=length,
                       enforce_eager=cpu, seed=0, **extra)

    def judge(self, prompts: Sequence[str]) -> List[str]:
        """The judge's greedy reply to each prompt, in order."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.settings.max_new_tokens)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    def pid(self) -> int:
        return os.getpid()


class JudgePool(ModelActorPool):
    """`reward.judge.num_workers` judge engines; the verifier actors' scorers call them directly."""
    worker_cls = JudgeWorker
