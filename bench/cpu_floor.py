"""Where this machine's CPU goes: is a step (or the test suite) waiting, or is it out of cores?

    .venv/bin/python bench/cpu_floor.py processes -- CMD [ARGS...]   # e.g. -- make test
    .venv/bin/python bench/cpu_floor.py phases [grpo train overrides...]
    .venv/bin/python bench/cpu_floor.py learner [--repeats 6] [--vocab-size V --groups N
        --prompt-tokens P --completion-tokens LO-HI --layouts group]

`processes` runs CMD and samples, every 0.5 s, the CPU time (user + system) of every process that
appears while it runs; it prints the CPU seconds per kind of process (a Ray actor by its class,
the `grpo` drivers, pytest, each of Ray's own daemons) and how many there were. Processes that
live under half a second are missed. The machine's busy fraction over the whole run is printed
too: near 100% means more workers or more overlap cannot make it faster, only less work can.
Before and after CMD it runs a fixed probe in a fresh process (importing torch and transformers'
model classes, then a one-thread matmul loop): this host's speed drifts and differs between
machines of the same size, so two runs' walls compare only beside their probes.

`phases` runs the GRPO driver in this process with the machine's busy fraction sampled every
50 ms and each timed phase of a step (generate, reward, train, weight sync) logged, and prints
the busy fraction inside each phase (steps 4 and later), and the CPU seconds each kind of
process used per step in each phase.

`learner` times one learner rank's update on its share of the default batch (32 groups of 8
completions, random ids) in plain processes on one thread each: alone, then two independent
processes at once, then two processes as one 2-rank DeepSpeed group (the job's layout). The
first against the second is what two compute-bound processes cost each other on these cores.
`--vocab-size`, `--groups`, `--prompt-tokens` and `--completion-tokens` change the built-in
model's vocabulary and the batch's shape (e.g. a real vocabulary with chat-length prompts);
`--layouts` picks which of the three to run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TICK = os.sysconf("SC_CLK_TCK")
RAY_DAEMONS = ("gcs_server", "raylet", "dashboard/agent", "dashboard.py", "log_monitor", "monitor.py",
               "runtime_env", "reward.scorer")


def machine_busy() -> tuple:
    """(busy, total) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        values = list(map(int, f.readline().split()[1:]))
    return sum(values) - values[3] - values[4], sum(values)


def process_cpu() -> dict:
    """{(pid, start time): (command line, kernel name, CPU seconds so far)} for every process now.
    An exiting process has no command line any more, and the kernel cuts its name to 15
    characters (ray::LearnerRan)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        found[(pid, fields[19])] = (cmd.strip(), name, (int(fields[11]) + int(fields[12])) / TICK)
    return found


def kind(cmd: str) -> str:
    actor = re.search(r"ray::(\w+)", cmd)
    if actor:
        return "ray::" + actor.group(1)
    if re.search(r"bin/grpo |cluster\.(train|cli)", cmd):
        return "grpo driver"
    if "pytest" in cmd or "xdist" in cmd:
        return "pytest (its workers run the in-process tests)"
    for daemon in RAY_DAEMONS:
        if daemon in cmd:
            return daemon
    if cmd.startswith("VLLM::"):
        return cmd.split()[0]
    return "other: " + " ".join(cmd.split())[:50]


# The two kinds of work the suite is made of: imports (most of an actor's start) and compute.
PROBE = """
import resource, time
import torch
torch.set_num_threads(1)
from transformers import Qwen2ForCausalLM
imported = resource.getrusage(resource.RUSAGE_SELF)
a = torch.randn(256, 256)
begun = time.process_time()
for _ in range(5000):
    a = torch.tanh(a @ a)
print(imported.ru_utime + imported.ru_stime, time.process_time() - begun)
"""


def host_probe() -> str:
    """The fixed probe's CPU seconds in a fresh process: its imports, then its compute (a probe
    that fails says so; the measurement goes on without it)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    try:
        imports, compute = map(float, done.stdout.split())
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"probe failed ({last[:120]})"
    return f"imports {imports:.2f} CPU-s, matmuls {compute:.2f} CPU-s"


def processes(command: list) -> None:
    probe_before = host_probe()
    before = set(process_cpu())
    busy0, total0 = machine_busy()
    started = time.time()
    child = subprocess.Popen(command)
    seen = {}
    while child.poll() is None:
        for key, (cmd, name, cpu) in process_cpu().items():
            if key not in before:
                known = seen.get(key, ("", 0.0))
                seen[key] = (cmd or known[0] or name, max(cpu, known[1]))
        time.sleep(0.5)
    busy1, total1 = machine_busy()
    wall = time.time() - started
    probe_after = host_probe()
    by_kind = collections.defaultdict(lambda: [0.0, 0])
    for cmd, cpu in seen.values():
        by_kind[kind(cmd)][0] += cpu
        by_kind[kind(cmd)][1] += 1
    total = sum(cpu for cpu, _ in by_kind.values())
    print(f"\n`{' '.join(command)}`: exit {child.returncode}, {wall:.0f} s wall, machine busy "
          f"{(busy1 - busy0) / max(total1 - total0, 1):.0%} of {os.cpu_count()} CPUs, "
          f"{total:.0f} CPU-s in the processes it started; host probe before: {probe_before}, "
          f"after: {probe_after}\n")
    print("| process | how many | CPU seconds | share | CPU seconds each |\n| --- | --- | --- | --- | --- |")
    for name, (cpu, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        if cpu >= 0.005 * total:
            print(f"| {name} | {count} | {cpu:.0f} | {cpu / total:.0%} | {cpu / count:.1f} |")


def phases(overrides: list) -> None:
    import cluster.loop.batches as batches
    from cluster.cli import main

    logged, samples, per_process = [], [], []
    timer = batches.Timer.__call__

    @contextlib.contextmanager
    def timed(self, name):
        begun = time.time()
        with timer(self, name):
            yield
        logged.append((name, begun, time.time()))

    batches.Timer.__call__ = timed
    done = threading.Event()

    def sample():
        previous = (time.time(), *machine_busy())
        while not done.wait(0.05):
            now, busy, total = time.time(), *machine_busy()
            samples.append((previous[0], now, (busy - previous[1]) / max(total - previous[2], 1)))
            previous = (now, busy, total)
            if len(samples) % 4 == 0:  # every 0.2 s: reading every process costs CPU itself
                per_process.append((now, {key: (kind(cmd or name), cpu)
                                         for key, (cmd, name, cpu) in process_cpu().items()}))

    threading.Thread(target=sample, daemon=True).start()
    sys.argv = ["grpo", "train", *overrides]
    try:
        main()
    except SystemExit as end:
        if end.code:
            raise
    finally:
        done.set()
    count, busy, cpu, steps = collections.Counter(), collections.defaultdict(list), {}, collections.Counter()
    for name, begun, ended in logged:
        count[name] += 1
        if count[name] <= 3:
            continue  # the first steps pay start-up costs
        steps[name] += 1
        busy[name] += [(min(ended, b) - max(begun, a), f) for a, b, f in samples if min(ended, b) > max(begun, a)]
        first = min(per_process, key=lambda s: abs(s[0] - begun))
        last = min(per_process, key=lambda s: abs(s[0] - ended))
        if last[0] <= first[0]:
            continue
        spent = cpu.setdefault(name, collections.Counter())
        for key, (what, seconds) in last[1].items():
            spent[what] += max(seconds - first[1].get(key, (what, seconds))[1], 0.0)
    for name, parts in busy.items():
        wall = sum(w for w, _ in parts)
        print(f"\n{name}: {wall / steps[name]:.2f} s per step, machine busy "
              f"{sum(w * f for w, f in parts) / max(wall, 1e-9):.0%} of {os.cpu_count()} CPUs")
        for what, seconds in cpu.get(name, collections.Counter()).most_common(5):
            print(f"    {seconds / steps[name]:.2f} CPU-s per step  {what}")
    print("\n(this process is the `grpo driver`; its sampling thread is counted with it)")


LAYOUTS = ("alone", "independent", "group")
LEARNER_CHILD = """
import random, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from common.config import AlgoConfig, LearnerConfig, ModelConfig
from common.prompt_group import PromptGroup
from learner.actor import LearnerRank
from data.tiny_model import build_tiny_model

rank, world, port, repeats = (int(a) for a in sys.argv[1:5])
VOCAB, GROUPS, PROMPT, SHORTEST, LONGEST = {shape!r}
path = build_tiny_model(ModelConfig(cache_dir={cache!r}, vocab_size=VOCAB,
                                    max_position_embeddings=max(128, PROMPT + LONGEST)))
learner = LearnerRank(rank, world, "127.0.0.1", port, path, LearnerConfig(num_ranks=world, num_threads=1),
                      AlgoConfig(), LONGEST, 0)
learner.snapshot_reference()
rng = random.Random(rank)
def groups(n, G=8):  # with the sampler's log-probs, as vLLM's groups have them (importance weights on)
    out = []
    for i in range(n):
        ids = [[rng.randrange(3, 200) for _ in range(rng.randint(SHORTEST, LONGEST))] for _ in range(G)]
        out.append(PromptGroup(index=i, prompt="", answer="", prompt_ids=[rng.randrange(3, 200) for _ in range(PROMPT)],
                               completions=[""] * G, policy_version=0, finish_reasons=["stop"] * G, completion_ids=ids,
                               rewards=[float(rng.random() < 0.3) for _ in range(G)],
                               sampler_logprobs=[[-5.5 + rng.random() for _ in c] for c in ids]))
    return out
for _ in range(2):
    learner.train_on(groups(GROUPS), 1.0, 1e-4)
times = []
for _ in range(repeats):
    begun = time.perf_counter()
    learner.train_on(groups(GROUPS), 1.0, 1e-4)
    times.append(time.perf_counter() - begun)
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(" ".join(f"{{t:.3f}}" for t in times), f"rss={{peak_mb}}", flush=True)
"""


def learner(repeats: int, cache: str, shape: tuple = (0, 32, 7, 16, 32), layouts=LAYOUTS) -> None:
    """`shape`: vocabulary (0: the tokenizer's), groups of 8 per rank, prompt tokens, shortest
    and longest completion."""
    from common.ray_utils import free_port

    code = LEARNER_CHILD.format(root=str(Path(__file__).resolve().parents[1]), cache=cache, shape=shape)

    def together(layout):
        children = [subprocess.Popen([sys.executable, "-c", code, str(r), str(w), str(p), str(repeats)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                    for r, w, p in layout]
        # The times and the peak resident memory are each child's last line (DeepSpeed logs to
        # stdout before them).
        out = [child.communicate()[0].strip().splitlines()[-1].split() for child in children]
        peak_mb = max(int(line[-1].removeprefix("rss=")) for line in out)
        return [float(t) for line in out for t in line[:-1]], peak_mb

    port = free_port()
    runs = {"alone": ("one rank alone (world 1)", [(0, 1, free_port())]),
            "independent": ("two independent ranks at once (world 1 each)",
                            [(0, 1, free_port()), (0, 1, free_port())]),
            "group": ("two ranks of one group at once (world 2: the job's layout)",
                      [(0, 2, port), (1, 2, port)])}
    rows = [(runs[k][0], together(runs[k][1])) for k in layouts]
    print(f"\n| one rank's update on its share ({shape[1]} groups x 8), 1 thread | median | range "
          "| peak memory of a rank |\n| --- | --- | --- | --- |")
    for name, (times, peak_mb) in rows:
        print(f"| {name} | {statistics.median(times):.3f} s | {min(times):.3f}-{max(times):.3f} s | {peak_mb} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("processes").add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("phases").add_argument("overrides", nargs="*")
    rank = sub.add_parser("learner")
    rank.add_argument("--repeats", type=int, default=6)
    rank.add_argument("--model-cache", default="runs/bench/models")
    rank.add_argument("--vocab-size", type=int, default=0, help="the built-in model's vocabulary (0: its tokenizer's)")
    rank.add_argument("--groups", type=int, default=32, help="groups of 8 completions per rank")
    rank.add_argument("--prompt-tokens", type=int, default=7)
    rank.add_argument("--completion-tokens", default="16-32", help="shortest-longest, drawn uniformly")
    rank.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    if args.what == "processes":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("processes: give the command after --")
        processes(command)
    elif args.what == "phases":
        phases(args.overrides)
    else:
        shortest, longest = (int(n) for n in args.completion_tokens.split("-"))
        learner(args.repeats, args.model_cache, (args.vocab_size, args.groups, args.prompt_tokens, shortest, longest),
                args.layouts)


if __name__ == "__main__":
    main()
