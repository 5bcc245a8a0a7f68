"""This project against TRL's GRPOTrainer, same machine, same start model, same settings.

    .venv/bin/pip install -e ".[bench]"         # brings trl (and accelerate); nothing else
    .venv/bin/python bench/vs_trl.py [--steps 20] [--start MODEL_DIR] [--lr LR] [overrides for ours...]
    # accuracy beside TRL's over several seeds (one sampled run each says little: see the table's range)
    .venv/bin/python bench/vs_trl.py --lr 1e-4 --lr-schedule constant --seeds 0 1 2
    # the 10 M model, 128-token completions, 16 prompts a step, untrained start:
    .venv/bin/python bench/vs_trl.py --steps 5 --no-warmup --prompts-per-step 16 --new-tokens 128 \
        --min-new-tokens 128 --model model.hidden_size=256 model.num_layers=10 model.intermediate_size=1024 \
        model.max_position_embeddings=256

1. The start model: the default job's post-warm-up policy (`grpo train trainer.max_steps=0`
   writes it as final_model/), unless --start names one; --model sets the built-in model's
   size, --no-warmup starts from it untrained (for speed alone).
2. This project: `grpo train model=hf model.path=START warmup.steps=0 trainer.max_steps=N`.
3. TRL 1.16 `GRPOTrainer` in its own process (one process, HF `generate`, both cores), from the
   same weights, for the same N GRPO steps.
Both then report seconds per GRPO step (median), completion tokens/s, held-out greedy accuracy
after the steps (the same held-out problems, scored by this project's math verifier) and the
time until the first step starts.

TRL settings, chosen to compute what this project computes by default: G = num_generations = 8;
64 prompts per step (generation_batch_size 512); steps_per_generation = 2 (learner.minibatches:
two optimizer steps per batch, the second off-policy, clipped); max_completion_length = 32;
temperature 1.0; learning_rate --lr (default 7e-4, the built-in job's GRPO rate); --lr-schedule
linear (default: this project decays to 0.1 of lr per GRPO step, TRL to 0 per optimizer step, the
nearest each has) or constant (identical in both); --min-new-tokens as vLLM's
min_tokens here and `min_new_tokens` in TRL's generation kwargs; beta 0.04 (k3 KL, as TRL computes it); epsilon 0.2; loss_type "grpo"
(sequence mean of token means, as algo.loss_agg=seq-mean-token-mean); scale_rewards "group";
rewards: math 1.0 + format 0.1, computed by this project's own verifier functions; float32 on
CPU (bf16=False), no vLLM (TRL's CPU path is HF generate); gradient_checkpointing=False (TRL's
default is True; this project does not recompute activations, and on this model it only costs
time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GRPO = str(Path(sys.executable).parent / "grpo")
G, BETA, EPS, MINIBATCHES = 8, 0.04, 0.2, 2


def shared_overrides(s: dict) -> list:
    """This project's config for the settings both runs share (`s`: the bench's arguments; the
    model's size is the start folder's)."""
    return [f"trainer.prompts_per_step={s['prompts_per_step']}", f"rollout.max_new_tokens={s['new_tokens']}",
            f"rollout.min_new_tokens={s['min_new_tokens']}", f"learner.lr={s['lr']}",
            f"learner.lr_schedule={s['lr_schedule']}",
            f"rollout.max_model_len={max(128, s['new_tokens'] + 64)}"]  # room for the prompt


def start_model(out: Path, overrides, warmup: bool) -> str:
    """The default job's policy after its warm-up (no GRPO step), as a Hugging Face folder; without
    `warmup`, the built-in model as initialised."""
    name = "start" if warmup else "start-untrained"
    if not (out / name / "final_model" / "config.json").exists():
        subprocess.run([GRPO, "train", "trainer.max_steps=0", f"trainer.run_name={name}", f"trainer.output_dir={out}",
                        "logger=none", "trainer.progress=false", *([] if warmup else ["warmup.steps=0"]), *overrides],
                       check=True)
    return str(out / name / "final_model")


def run_ours(start: str, steps: int, out: Path, overrides) -> dict:
    name = f"ours-{time.strftime('%H%M%S')}"
    begun = time.time()
    subprocess.run([GRPO, "train", "model=hf", f"model.path={start}", "warmup.steps=0",
                    f"trainer.max_steps={steps}", "trainer.eval_every=0", f"trainer.run_name={name}",
                    f"trainer.output_dir={out}", "logger=none", "trainer.progress=false", *overrides], check=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / name / "summary.json").read_text())
    first_start = rows[0]["wall_seconds"] - rows[0]["time_step"]  # since the driver started
    steps_s = [r["time_step"] for r in rows]
    return {"step_s": statistics.median(steps_s),
            "tokens_per_s": sum(r["completion_tokens"] for r in rows) / sum(steps_s),
            "before": summary["heldout_accuracy_before"], "after": summary["heldout_accuracy_after"],
            "startup_s": first_start, "process_s": time.time() - begun}


# ---- TRL, in a process of its own ------------------------------------------------------------
def run_trl(start: str, steps: int, out: Path, seed: int, settings: dict) -> dict:
    result = out / f"trl-{time.strftime('%H%M%S')}.json"
    begun = time.time()
    subprocess.run([sys.executable, __file__, "--trl-child", start, str(steps), str(result), str(seed),
                    json.dumps(settings)], check=True)
    return {**json.loads(result.read_text()), "process_s": time.time() - begun}


def trl_child(start: str, steps: int, result: str, seed: int, settings: dict) -> None:
    born = time.time()
    prompts_per_step, new_tokens = settings["prompts_per_step"], settings["new_tokens"]
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.config import DataConfig
    from reward.verifiers import format_score, math_score
    from data.datasets import load_problems

    heldout, train = load_problems(DataConfig(), seed)
    tokenizer = AutoTokenizer.from_pretrained(start)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in train])

    def math_reward(prompts, completions, answer, **_):
        return [math_score(c, a) for c, a in zip(completions, answer)]

    def format_reward(completions, **_):
        return [format_score(c) for c in completions]

    class Clock(TrainerCallback):
        """Wall time at each optimizer step's end (a GRPO step is MINIBATCHES of them)."""
        first_begin, ends = None, []

        def on_step_begin(self, args, state, control, **kw):
            if Clock.first_begin is None:
                Clock.first_begin = time.time()

        def on_step_end(self, args, state, control, **kw):
            Clock.ends.append(time.time())

    config = GRPOConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=steps * MINIBATCHES, learning_rate=settings["lr"],
        lr_scheduler_type=settings["lr_schedule"], per_device_train_batch_size=prompts_per_step * G // MINIBATCHES,
        steps_per_generation=MINIBATCHES, num_generations=G, max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": settings["min_new_tokens"]} if settings["min_new_tokens"] else None,
        temperature=1.0, beta=BETA, epsilon=EPS, loss_type="grpo", scale_rewards="group",
        reward_weights=[1.0, 0.1], use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        logging_steps=1, save_strategy="no",
        seed=seed, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[math_reward, format_reward], args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    ends = [Clock.first_begin] + Clock.ends[MINIBATCHES - 1::MINIBATCHES]
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    # TRL logs a generation's completion lengths once, at the first optimizer step after it.
    logs = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    assert len(logs) == steps, f"{len(logs)} generations logged for {steps} GRPO steps"
    tokens = sum(length * prompts_per_step * G for length in logs)
    accuracy = greedy_accuracy(trainer.model, tokenizer, heldout, math_score, new_tokens)
    Path(result).write_text(json.dumps({
        "step_s": statistics.median(step_s), "tokens_per_s": tokens / sum(step_s), "after": accuracy,
        "startup_s": Clock.first_begin - born, "torch_threads": torch.get_num_threads()}))


def greedy_accuracy(model, tokenizer, problems, score, new_tokens: int) -> float:
    import torch

    # Left in training mode with gradient checkpointing, HF generate drops its KV cache and
    # decodes garbage (an earlier run of this bench scored TRL's model 0.0% so).
    model.eval()
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id
    right = 0
    with torch.no_grad():
        for i in range(0, len(problems), 64):
            chunk = problems[i:i + 64]
            enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            right += sum(score(t, p.answer) for t, p in zip(texts, chunk))
    return right / len(problems)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        trl_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), json.loads(sys.argv[6]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--start", default=None, help="a Hugging Face folder to start both from")
    parser.add_argument("--output-dir", default="runs/vs_trl")
    parser.add_argument("--seed", type=int, default=0, help="the start model's seed (its warm-up and data)")
    parser.add_argument("--seeds", type=int, nargs="*", default=None,
                        help="run both once per seed (sampling, prompt order, held-out problems) from the same "
                             "start model, this project then TRL, seed after seed; the table shows the mean and the "
                             "range, and the speed ratio per seed (default: --seed and the two after it)")
    parser.add_argument("--lr", type=float, default=7e-4, help="both runs' learning rate")
    parser.add_argument("--lr-schedule", choices=("linear", "constant"), default="linear",
                        help="linear: this project decays to 0.1 of lr per GRPO step, TRL to 0 per optimizer "
                             "step (the nearest each has); constant: identical in both")
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32, help="max completion tokens, both runs")
    parser.add_argument("--min-new-tokens", type=int, default=0, help="min completion tokens, both runs")
    parser.add_argument("--model", nargs="*", default=[], help="built-in model size, e.g. model.hidden_size=256")
    parser.add_argument("--no-warmup", action="store_true", help="start from the untrained built-in model")
    parser.add_argument("overrides", nargs="*", help="for this project's runs (e.g. rollout.chunks_per_worker=1)")
    args = parser.parse_args()
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = {"prompts_per_step": args.prompts_per_step, "new_tokens": args.new_tokens,
                "min_new_tokens": args.min_new_tokens, "lr": args.lr, "lr_schedule": args.lr_schedule,
                "model": args.model}
    start = args.start or start_model(out, [f"trainer.seed={args.seed}", *args.model], not args.no_warmup)
    from bench import results_io
    from bench.compare import Comparison

    result = results_io.Result("vs_trl")
    runs = []
    # One pair per seed, this project then TRL (A B A B ...): the speed ratio is taken within a
    # pair, so the host's drift between pairs does not decide it (bench/compare.py).
    for seed in args.seeds if args.seeds is not None else [args.seed, args.seed + 1, args.seed + 2]:
        ours = run_ours(start, args.steps, out, [f"trainer.seed={seed}", *shared_overrides(settings), *args.overrides])
        runs.append((seed, ours, run_trl(start, args.steps, out, seed, settings)))
        result.add_run({"seed": seed, "this_project": ours, "trl": runs[-1][2]})
    table = format_table(start, args.steps, runs)
    step = Comparison(a=[r[1]["step_s"] for r in runs], b=[r[2]["step_s"] for r in runs], lower_is_better=True,
                      label_a="this project", label_b="TRL")
    print(table)
    print(f"seconds per GRPO step, speed ratio per seed: {step.sentence()}")
    (out / "vs_trl.md").write_text(f"command: {' '.join(sys.argv)}\n\n{table}\n")
    result.write({"start": start, "settings": settings, "step_speed_ratio": step.summary(),
                  "after_this_project": results_io.spread(r[1]["after"] for r in runs),
                  "after_trl": results_io.spread(r[2]["after"] for r in runs)})


ROWS = [("seconds per GRPO step (median)", "step_s", "{:.2f}"),
        ("completion tokens/s", "tokens_per_s", "{:.0f}"),
        ("held-out greedy accuracy after the steps", "after", "{:.1%}"),
        ("seconds until the first step starts", "startup_s", "{:.0f}"),
        ("whole process, seconds", "process_s", "{:.0f}")]
SPEEDS = ("step_s", "startup_s", "process_s")  # shown as TRL / this project: above 1x this project is faster


def format_table(start: str, steps: int, runs) -> str:
    """One row per measure: each side's mean over the seeds (with the range when there are
    several) and the ratio of the means; then the accuracies seed by seed."""
    def cell(values: list, fmt: str) -> str:
        spread = f" ({fmt.format(min(values))} to {fmt.format(max(values))})" if len(values) > 1 else ""
        return fmt.format(statistics.fmean(values)) + spread

    seeds = [seed for seed, _, _ in runs]
    lines = [f"start model: {start}; {steps} GRPO steps each; seeds {seeds}"
             + (", means over them (range)" if len(runs) > 1 else ""),
             "", "| | this project | TRL GRPOTrainer | this project / TRL |", "| --- | --- | --- | --- |"]
    for label, key, fmt in ROWS:
        ours, trl = ([r[side][key] for r in runs] for side in (1, 2))
        mean_ours, mean_trl = statistics.fmean(ours), statistics.fmean(trl)
        ratio = (mean_trl / mean_ours if key in SPEEDS else mean_ours / mean_trl) if mean_trl and mean_ours \
            else float("nan")
        shown = f"{ratio:.2f}x" if ratio == ratio else "n/a"  # NaN: a value was 0
        lines.append(f"| {label} | {cell(ours, fmt)} | {cell(trl, fmt)} | {shown} |")
    lines.append("\n(ratios are speed ratios: above 1x this project is faster; for accuracy, the plain ratio)")
    lines += ["", "| seed | held-out before (both) | this project after | TRL after | difference (points) |",
              "| --- | --- | --- | --- | --- |"]
    for seed, ours, trl in runs:
        lines.append(f"| {seed} | {ours['before']:.1%} | {ours['after']:.1%} | {trl['after']:.1%} | "
                     f"{100 * (ours['after'] - trl['after']):+.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
