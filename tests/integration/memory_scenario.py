"""Run in its own process by tests/integration/test_learner_memory.py: real GRPO steps of the learner (DeepSpeed on
the CPU, world size 1, no Ray) on a model with Qwen2.5's 151,936-token vocabulary and 700-token
sequences, under a micro-batch token budget, for each batch size given. Prints one JSON line:
for each batch, how far the process's peak resident memory rose above what it held before the
step (the kernel's peak, VmHWM, is reset between steps)."""
from __future__ import annotations

import json
import random
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 151936
SEQ = 700


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def main(cache: str, budget: int, batches) -> None:
    import torch

    from common.config import AlgoConfig, LearnerConfig, ModelConfig
    from learner.actor import LearnerRank
    from data.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(ModelConfig(cache_dir=cache, hidden_size=32, num_layers=1, num_heads=2,
                                        intermediate_size=64, max_position_embeddings=1024, vocab_size=VOCAB))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    learner_cfg = LearnerConfig(num_ranks=1, minibatches=1, max_tokens_per_microbatch=budget)
    rank = LearnerRank(0, 1, "127.0.0.1", port, path, learner_cfg, AlgoConfig(), SEQ, 0)
    rank.snapshot_reference()  # beta > 0: the reference forward is part of the step
    out = {}
    for rows in batches:  # a batch size given twice is reported as its last step
        groups = _groups(rows)
        _reset_peak()
        before = _status_bytes("VmRSS")
        metrics = rank.train_on(groups, temperature=1.0, lr=1e-3)
        out[rows] = {"rise_bytes": _status_bytes("VmHWM") - before, "micro_batches": metrics["micro_batches"]}
    print(json.dumps(out), flush=True)


def _groups(rows: int):
    from common.prompt_group import PromptGroup

    rng = random.Random(rows)
    G = 2
    return [PromptGroup(index=i, prompt="", answer="", prompt_ids=[rng.randrange(2, 258) for _ in range(100)],
                        completions=[""] * G, policy_version=0, finish_reasons=["stop"] * G,
                        completion_ids=[[rng.randrange(2, VOCAB) for _ in range(SEQ - 100)] for _ in range(G)],
                        rewards=[float(j) for j in range(G)]) for i in range(rows // G)]


def logprobs(cache: str, rows: int) -> None:
    """learner/logprobs.py's call as the learner makes it (with entropy, then the backward of a
    weighted sum) on `rows` x 512 tokens of a 64-wide model at the real vocabulary: the rise of
    the process's peak, with learner/memory_plan.py's terms for the same micro-batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.config import ModelConfig
    from data.tiny_model import build_tiny_model
    from learner.logprobs import token_logprobs
    from learner.memory_plan import ModelShape

    torch.set_num_threads(1)
    path = build_tiny_model(ModelConfig(cache_dir=cache, hidden_size=64, num_layers=1, num_heads=2,
                                        intermediate_size=128, max_position_embeddings=512, vocab_size=VOCAB))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(2, VOCAB, (rows, 512))
    targets = torch.ones((rows, 511), dtype=torch.bool)
    weights = torch.randn(rows, 511)
    rises = []
    for _ in range(2):  # the first call's one-time allocations are not measured
        _reset_peak()
        before = _status_bytes("VmRSS")
        chosen, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0, with_entropy=True, targets=targets)
        (chosen * weights).sum().backward()
        rises.append(_status_bytes("VmHWM") - before)
        model.zero_grad(set_to_none=True)
        del chosen
    shape = ModelShape.from_folder(path)
    tokens = rows * 512
    plan = (tokens * shape.activation_bytes_per_token(4, False) + shape.logits_bytes(tokens, 4)
            + shape.logprob_working_bytes(tokens, 4) + shape.parameters() * 4)  # and the model's own gradients
    print(json.dumps({"rise_bytes": rises[-1], "logits_bytes": rows * 511 * VOCAB * 4, "plan_bytes": plan}), flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "logprobs":
        logprobs(sys.argv[1], int(sys.argv[3]))
    else:
        main(sys.argv[1], int(sys.argv[2]), [int(a) for a in sys.argv[3:]])
