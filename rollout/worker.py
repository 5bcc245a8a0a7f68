"""vLLM generation workers: Ray actors that sample G completions per prompt with the current policy.

Each worker puts every prompt group it makes into the Ray object store itself and returns only
the references, so the payloads go from worker to learner without passing through the driver.
"""
from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import ray

from cluster.prompt_group import PromptGroup

RECEIVER_CLASS = "rollout.weight_receiver.WeightReceiver"


class GenerationWorker:
    """One vLLM engine (one Ray actor). `policy_version` is the version of the weights it holds."""

    def __init__(self, model_path: str, rollout_cfg: dict, seed: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(rollout_cfg["kv_cache_gib"]))))
        from vllm import LLM

        self.cfg = rollout_cfg
        self.llm = LLM(
            model=model_path,
            dtype=rollout_cfg["dtype"],
            max_model_len=rollout_cfg["max_model_len"],
            gpu_memory_utilization=rollout_cfg["gpu_memory_utilization"],
            enforce_eager=True,
            seed=seed,
            worker_extension_cls=RECEIVER_CLASS,
        )
        self.policy_version = 0

    def ready(self) -> int:
        return self.policy_version

    def generate(self, prompts: Sequence[Tuple[int, str, str, dict]], n: int, greedy: bool,
                 seeds: Sequence[int]) -> List[ray.ObjectRef]:
        """Sample `n` completions for each (index, prompt, answer, row fields); one seed per prompt
        makes it reproducible."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else self.cfg["temperature"],
                top_p=1.0 if greedy else self.cfg["top_p"],
                max_tokens=self.cfg["max_new_tokens"],
                seed=seed,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([p[1] for p in prompts], params, use_tqdm=False)
        refs = []
        for (index, prompt, answer, fields), out in zip(prompts, outputs):
            group = PromptGroup(
                index=index,
                prompt=prompt,
                answer=answer,
                fields=fields,
                prompt_ids=list(out.prompt_token_ids),
                completions=[c.text for c in out.outputs],
                completion_ids=[list(c.token_ids) for c in out.outputs],
                finish_reasons=[c.finish_reason or "length" for c in out.outputs],
                policy_version=self.policy_version,
            )
            refs.append(ray.put(group))
        return refs

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.llm.collective_rpc("init_weight_sync", args=(host, port, rank, world_size, timeout_s))

    def receive_weights(self, wire_spec: dict, version: int) -> dict:
        """Load new weights from the sync group; report the version now held."""
        timings = self.llm.collective_rpc("receive_weights", args=(wire_spec,))[0]
        # Cached prefixes were computed by the old weights: drop them or they leak into new samples.
        self.llm.reset_prefix_cache()
        self.policy_version = version
        return {"policy_version": version, **timings}

    def weights_checksum(self) -> float:
        return self.llm.collective_rpc("weights_checksum")[0]
