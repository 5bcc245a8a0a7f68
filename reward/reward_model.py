"""A reward model as a verifier: `reward_model` scores prompt + completion with a Hugging Face
sequence-classification model (one logit) served by a pool of Ray actors of its own.

Why a verifier backed by its own pool, and not a second `reward.scorer`: its score then joins the
rule verifiers' through `reward.weights` (a format bonus beside the model, or a model beside
`math` for a run that measures what the model rewards), and the verifier pool keeps its
chunking, its per-verifier metrics and its restarts. The model lives in actors of its own (one
copy per `reward.model.num_workers`, on CPUs or GPUs) rather than in every verifier actor, so
its size and its device are the reward model's own choice. Each verifier actor's scorer
(reward/model_scorer.py) runs the rule verifiers in its killable child process as before, sends
the texts to the model actors, and adds the model's score to each outcome.

Faults: a model actor that dies is restarted by Ray (`max_restarts=-1`) and the batch that was
in flight runs again on it (`max_task_retries`), so every completion gets exactly one score; a
batch not scored within `reward.model.timeout_s` scores 0 and is counted as timed out.
"""
from __future__ import annotations

import os
from typing import List, Sequence


from common.config import RewardModelConfig
from reward.model_pool import ModelActorPool
from reward.registry import MODEL_VERIFIERS, check_reward_model

__all__ = ["MODEL_VERIFIERS", "RewardModelPool", "RewardModelWorker", "check_reward_model",
           "model_text"]  # the first and the check live in reward/registry.py (no Ray there)

"""Re-runs of one batch after its actor died (each on the restarted actor)."""


def model_text(prompt: str, completion: str) -> str:
    """What the reward model reads: the prompt as the policy saw it, then the completion."""
    return prompt + completion


class RewardModelWorker:
    """One model actor: the model loaded once, batches of texts scored by one forward each."""

    def __init__(self, settings: RewardModelConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.settings = settings
        self.device = "cuda" if settings.num_gpus_per_worker > 0 else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(max(1, int(settings.num_cpus_per_worker)))
        path = os.path.expanduser(settings.path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch.bfloat16 if self.device == "cuda" else torch.float32).to(self.device).eval()
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = int(limit) if limit else None

    def score(self, texts: Sequence[str]) -> List[float]:
        """The model's logit (or its sigmoid) for each text, in order."""
        import torch

        out: List[float] = []
        for start in range(0, len(texts), self.settings.batch_size):
            batch = self.tokenizer(list(texts[start:start + self.settings.batch_size]), return_tensors="pt",
                                   padding=True, truncation=self.max_length is not None, max_length=self.max_length)
            with torch.no_grad():
                logits = self.model(**batch.to(self.device)).logits[:, 0].float()
            if self.settings.normalize == "sigmoid":
                logits = torch.sigmoid(logits)
            out.extend(logits.cpu().tolist())
        return out

    def pid(self) -> int:
        return os.getpid()


class RewardModelPool(ModelActorPool):
    """`reward.model.num_workers` model actors; the verifier actors' scorers call them directly."""
    worker_cls = RewardModelWorker
