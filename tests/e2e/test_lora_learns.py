"""A short `grpo train` with LoRA learns the built-in task: the default job's warm-up trains the
whole model, then GRPO trains rank-16 adapters on it under ZeRO-3 (every step's push sends only
the adapters), and held-out greedy accuracy must rise by more than its sampling noise. The same
run's final model is its last checkpoint's `grpo export --merged`, and the checkpoint's adapter
folder is the final model's.

Settings (bench/default_run.py with these overrides, docs/learner.md "LoRA"): steps of the
default batch (64 prompts x 8) at the default learner.lr. Held-out gains on 400 problems for
seeds 0-3, where `learned` asks for 7.5-8.2 points: 12 steps (this test, seed 0; one engine)
gained 14.5, 12.5, 13.5 and 16.5 points; 20 steps (two engines) gained 18.0, 15.2, 17.0 and
18.5, their step 12 (of the 20-step schedule) 16.5, 12.0, 14.0 and 16.2.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers import GRPO, learned, run

STEPS = 12
LR = "7e-4"
HELDOUT = 400


def _tensors(folder: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / name))


def test_grpo_on_lora_adapters_learns_the_built_in_task(tmp_path, model_cache):
    result = run(GRPO, "train", f"model.cache_dir={model_cache}", f"trainer.output_dir={tmp_path}",
                 "trainer.run_name=lora", "trainer.progress=false", "logger=none", f"trainer.max_steps={STEPS}",
                 f"trainer.save_every={STEPS}", f"data.heldout_size={HELDOUT}", "learner.lora.rank=16",
                 f"learner.lr={LR}", "learner.zero_stage=3", "rollout.dtype=float32",
                 # Other tests' engines run beside these: the default 1 GiB of KV cache each is too much.
                 "rollout.kv_cache_gib=0.25",
                 # One engine and one verifier: seeded samples are the same whichever engine draws
                 # them, and the pools are the session roles' tests; an engine costs ~10 CPU-s to start.
                 "rollout.num_workers=1", "reward.num_workers=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "lora"
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    assert summary["heldout_size"] == HELDOUT and summary["grpo_steps"] == STEPS
    assert learned(before, after, HELDOUT), f"GRPO on LoRA adapters: held-out {before:.1%} -> {after:.1%}"

    checkpoint = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    adapters = _tensors(checkpoint / "adapter", "adapter_model.safetensors")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Each step pushed the adapters alone, in float32 (the base went once, before the first step).
    assert {r["sync_bytes"] for r in rows} == {4 * sum(t.numel() for t in adapters.values())}
    final = run_dir / "final_model"
    saved = _tensors(final / "adapter", "adapter_model.safetensors")
    assert saved.keys() == adapters.keys() and all(torch.equal(saved[k], adapters[k]) for k in adapters)
    exported = run(GRPO, "export", str(checkpoint), str(tmp_path / "merged"), "--merged")
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    merged, model = _tensors(tmp_path / "merged", "model.safetensors"), _tensors(final, "model.safetensors")
    assert merged.keys() == model.keys() and all(torch.equal(merged[k], model[k]) for k in model), \
        [k for k in model if not torch.equal(merged[k], model[k])]
