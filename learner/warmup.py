"""The supervised warm-up: (prompt, target) pairs tokenised once, then trained in chunks on the
policy, loss on the trained target tokens only."""
from __future__ import annotations

import random
from typing import List, Optional

from learner.batching import model_tokens_only, pad
from learner.logprobs import token_logprobs
from learner.policy import PolicyModel


class Warmup:
    def __init__(self, tokenizer, pad_id: int, rank: int, world_size: int):
        self.tokenizer, self.pad_id, self.rank, self.world_size = tokenizer, pad_id, rank, world_size
        self.examples: List[tuple] = []

    def load(self, examples: List[tuple], end_ids: Optional[List[int]] = None) -> int:
        """Tokenise the (prompt, target) pairs once; the warm-up then runs in chunks. A target is
        text, or (text, trained) segments (a tool-using trace: each segment tokenized on its
        own, as an episode is, and the untrained ones out of the loss). Each target ends with
        `end_ids` (a chat format's end-of-turn token), by default the tokenizer's EOS."""
        if end_ids is None:
            end_ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.examples = []
        for prompt, target in examples:
            segments = [(target, True)] if isinstance(target, str) else list(target)
            ids, mask = [], []
            for text, trained in segments:
                piece = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(trained)] * len(piece)
            self.examples.append((self.tokenizer(prompt)["input_ids"], ids + list(end_ids),
                                  mask + [1] * len(end_ids)))
        return len(self.examples)

    def run(self, policy: PolicyModel, steps: int, batch_size: int, lr: float, seed: int) -> List[float]:
        """Supervised steps on the loaded pairs; loss on the trained target tokens only.

        Every rank draws the same global batch from the same seed and trains on its slice, so
        all ranks take the same number of steps (each step is a collective).
        """
        policy.set_lr(lr)
        rng = random.Random(seed)
        per_rank = batch_size // self.world_size
        encoded = self.examples
        losses = []
        engine = policy.engine
        engine.train()
        for _ in range(steps):
            batch = rng.sample(range(len(encoded)), batch_size)[self.rank * per_rank:(self.rank + 1) * per_rank]
            starts = [len(encoded[i][0]) for i in batch]
            ids, attention, mask = pad([encoded[i][0] + encoded[i][1] for i in batch], starts, self.pad_id,
                                       policy.device)
            mask = model_tokens_only(mask, [encoded[i][2] for i in batch], starts)
            logprobs = token_logprobs(engine, ids, attention, targets=mask)
            loss = -(logprobs * mask).sum() / mask.sum()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return losses  # train_step sets the GRPO lr of each step itself
