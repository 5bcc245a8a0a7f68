"""Chaos: a default-shaped run during which a role is SIGKILLed every few steps, against a
straight run of the same settings.

    .venv/bin/python bench/chaos.py --steps 30 --every 4 --modes sync async streaming

For each mode: a straight `grpo train`, then the same run while this script kills, at every
`--every`-th step logged, one of (in a seeded random order, each kind at least once): a
generation worker, a verifier actor, a learner rank (SIGKILL of the actor's process, found
among the run's own processes by Ray's process title), the driver (SIGKILL, then
`trainer.resume=auto`) and the driver by SIGTERM (then `trainer.resume=auto`). Prints and
writes (`--output`) the kills survived, the recovery seconds per kind (in-run kinds: the
run's own "back in" figure; driver and SIGTERM: from the kill until the new process has
resumed its checkpoint), and whether the final weights and samples.jsonl equal the straight
run's. Mode `streaming` is async mode with rollout.streaming and rollout.partial: its runs are
not bit-exact repeats (how far a request got at a push depends on timing), so what must hold
there is `same_prompts` (every step trains the straight run's prompts and samples, each once;
samples.jsonl without the versions).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(Path(sys.executable).parent / "grpo")
IN_RUN = {"generation worker": "ray::GenerationWorker", "verifier": "ray::VerifierWorker", "learner rank": "ray::LearnerRank"}
KINDS = [*IN_RUN, "driver", "SIGTERM"]
MODES = {"sync": ["trainer.mode=sync"], "async": ["trainer.mode=async"],
         "streaming": ["trainer.mode=async", "rollout.streaming=true", "rollout.partial=true"]}


def overrides(out: Path, name: str, mode: str, steps: int, extra) -> list:
    return [f"trainer.output_dir={out}", f"trainer.run_name={name}", *MODES[mode],
            f"trainer.max_steps={steps}", "trainer.progress=false", "logger=none", *extra]


def logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_actor(driver: psutil.Process, title: str) -> int:
    """SIGKILL one of this run's actor processes whose title starts with `title`; its pid."""
    for child in driver.children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith(title):
                child.send_signal(signal.SIGKILL)
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no process titled {title} under the driver {driver.pid}")


def watch(cmd: list, run_dir: Path, pending: list, kills: list, resumes: list, log: Path) -> tuple:
    """Run one `grpo train` process, killing what `pending` says as the steps are logged;
    returns (its exit status, its stdout)."""
    lines: list = []
    for entry in resumes:  # a kill of an earlier process: this one's "resumed from" answers it
        entry["new_process"] = True
    with log.open("a") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sink, text=True)
        driver = psutil.Process(proc.pid)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        while proc.poll() is None:
            note_resumed(resumes, lines)
            if pending and logged(run_dir) >= pending[0][0]:
                step, kind = pending.pop(0)
                kills.append({"step": step, "kind": kind})
                if kind in IN_RUN:
                    kill_actor(driver, IN_RUN[kind])
                else:
                    proc.send_signal(signal.SIGKILL if kind == "driver" else signal.SIGTERM)
                    resumes.append({"kind": kind, "t0": time.monotonic()})
            time.sleep(0.2)
        reader.join(timeout=30)
        note_resumed(resumes, lines)
        sink.write("".join(lines))
    return proc.returncode, "".join(lines)


def note_resumed(resumes: list, lines: list) -> None:
    if resumes and resumes[-1].get("new_process") and "at" not in resumes[-1] and \
            any("resumed from" in line for line in lines):
        resumes[-1]["at"] = time.monotonic() - resumes[-1]["t0"]


def chaos_run(out: Path, args, mode: str, schedule: list) -> dict:
    name = f"chaos-{mode}"
    base = [GRPO, "train", *overrides(out, name, mode, args.steps, args.overrides)]
    run_dir, log = out / name, out / f"{name}.log"
    kills, resumes, text, pending, resume = [], [], "", list(schedule), []
    started = time.monotonic()
    while True:
        status, stdout = watch(base + resume, run_dir, pending, kills, resumes, log)
        text += stdout
        if status == 0:
            break
        if status not in (-9, 143) or time.monotonic() - started > args.minutes * 60:
            raise RuntimeError(f"{name} ended with status {status}; see {log}")
        resume = ["trainer.resume=auto"]
    return {"kills": kills, "resumes": resumes, "stdout": text, "run_dir": run_dir}


def back_in(stdout: str) -> dict:
    """Seconds of each in-run recovery, from the driver's restart lines."""
    found = {}
    for line in stdout.splitlines():
        m = re.search(r"step \d+: (generation worker|verifier|learner rank)( \d+)? died.*?(?:back in ([\d.]+) s)?$", line)
        if m:
            found.setdefault(m.group(1), []).append(float(m.group(3)) if m.group(3) else None)
    return found


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    x, y = load_file(str(a / "final_model" / "model.safetensors")), load_file(str(b / "final_model" / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def one_mode(out: Path, args, mode: str) -> dict:
    straight = subprocess.run([GRPO, "train", *overrides(out, f"straight-{mode}", mode, args.steps, args.overrides)],
                              capture_output=True, text=True)
    if straight.returncode:
        raise RuntimeError(straight.stderr[-2000:])
    rng = random.Random(args.seed)
    kinds = KINDS + [rng.choice(list(IN_RUN)) for _ in range(max(0, args.steps // args.every - 1 - len(KINDS)))]
    rng.shuffle(kinds)
    schedule = [(args.every * (i + 1), kind) for i, kind in enumerate(kinds) if args.every * (i + 1) < args.steps]
    chaos = chaos_run(out, args, mode, schedule)
    sys.path.insert(0, str(ROOT))
    from cluster.loop.samples import read

    return {"mode": mode, "kills": chaos["kills"], "in_run_seconds": back_in(chaos["stdout"]),
            "resume_seconds": [{"kind": r["kind"], "seconds": round(r.get("at", float("nan")), 1)} for r in chaos["resumes"]],
            "steps_logged": [json.loads(line)["step"] for line in (chaos["run_dir"] / "metrics.jsonl").read_text().splitlines()],
            "same_weights": same_weights(out / f"straight-{mode}", chaos["run_dir"]),
            "same_samples": read(out / f"straight-{mode}") == read(chaos["run_dir"]),
            "same_prompts": [s[:3] for s in read(out / f"straight-{mode}")] == [s[:3] for s in read(chaos["run_dir"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=4, help="a kill every N steps logged")
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=40, help="give up on a chaos run after this long")
    parser.add_argument("--out", default="runs/chaos")
    parser.add_argument("--output", default=None, help="the JSON result (default bench/results/chaos.json)")
    parser.add_argument("overrides", nargs="*", help="more grpo train overrides (both runs)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import results_io

    record = results_io.Result("chaos")
    out = Path(args.out).resolve()
    results = []
    for mode in args.modes:
        result = one_mode(out, args, mode)
        results.append(result)
        record.add_run(result)
        print(json.dumps(result), flush=True)
    record.write({r["mode"]: {"kills": len(r["kills"]),
                              "steps_logged_once": r["steps_logged"] == sorted(set(r["steps_logged"])),
                              "same_weights": r["same_weights"], "same_samples": r["same_samples"],
                              "same_prompts": r["same_prompts"]}
                  for r in results}, path=Path(args.output) if args.output else None, args=vars(args))


if __name__ == "__main__":
    main()
