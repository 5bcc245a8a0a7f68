"""Completion tokens/s of an agent through the endpoint against the built-in episode loop.

    .venv/bin/python bench/agent_throughput.py [--steps 6] [--warmup-steps 300 | --model DIR] [--output-dir runs/bench] \
        [--extra-layers N] [--runs agent,loop] [overrides...]
    .venv/bin/python bench/agent_throughput.py --client-floor

On the multiplication task with the model for agents: one `grpo train data=mul_agent` run
whose supervised warm-up teaches the model the calculator's call (its final_model is then the
model of both measured runs, so both start from the same weights and make real calls), then,
from that model with no warm-up, `--steps` GRPO steps each of

- `agent`: every sample an episode of examples/calculator_agent.py (offering the loop's own
  schema of the calculator: same_schema_agent), which talks to its
  session of a generation worker's OpenAI-compatible endpoint with the `openai` client;
- `async agent`: the same as an `async def` (examples/calculator_agent.py's run_async), whose
  episodes share the agent processes (rollout.agent_episodes_per_process);
- `loop`: the built-in episode loop doing the same calls in the same format
  (`rollout.tool_format=hermes`, the calculator as a tool in the chat template's tools section).

Reported from each run's metrics.jsonl over the steps after the first: sampled completion tokens
per second of generation (tool results excluded: the episode loop counts them in
completion_tokens and reports their share), turns per episode, and the agent's ratio to the loop.
The two runs' samples differ (the agent's tool description is its own, and a call's result is
read by the agent's parser or the loop's), so the turns per episode are printed beside the rates.

`--extra-layers N` measures the same with the model deepened by N blocks that leave its output
unchanged (`deepened`): the same calls at a larger model's sampling cost, the endpoint's and the
agents' cost a request the same. `--runs` picks the agent runs (the loop always runs). The runs
go in rounds (`--pairs`, 3 by default: the agent runs then the loop, the other way round in the
next round, and so on), and each
agent's ratio to the loop is taken within a round and reported as the median with its range
(bench/compare.py), so that the host's drift between rounds does not decide it.

Beside the rates, each run's CPU seconds a step (generation workers, agent processes: read from
/proc) and, from them, the ratio an endpoint that cost nothing would reach: the loop's sampling
CPU over that plus the agents' own. `--client-floor` measures what the `openai` client alone
costs a request against a bare FastAPI server answering a fixed reply.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.results_io, bench.compare
GRPO = str(Path(sys.executable).parent / "grpo")
COMMON = ["data=mul_agent", "trainer.progress=false", "logger=none", "trainer.eval_every=0", "trainer.save_every=0",
          "trainer.max_restarts=0", "data.heldout_size=8"]  # the held-out accuracy is not what is measured


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (other jobs on the machine change every figure)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


ROLES = {"generation workers": "ray::GenerationWorker", "agent processes": "multiprocessing.forkserver",
         "learner ranks": "ray::LearnerRank"}
"""CPU time per step is summed over the processes whose command line holds these markers (an
agent's process is forked from multiprocessing's fork server and keeps its command line)."""


def cpu_seconds() -> dict:
    """CPU seconds (user + system) used so far by the live processes of each of ROLES."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys(ROLES, 0.0)
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended meanwhile, or not a process
        for role, marker in ROLES.items():
            if marker in command:
                totals[role] += (int(fields[11]) + int(fields[12])) / tick
    return totals


def train(out: Path, name: str, *overrides: str) -> Path:
    """One run; records in `cpu.json` the CPU seconds per step of each of ROLES over the steps
    after the first (read when the first step's and the last step's metrics are written)."""
    run = subprocess.Popen([GRPO, "train", *COMMON, f"trainer.output_dir={out}", f"trainer.run_name={name}",
                            *overrides])
    metrics, marks = out / name / "metrics.jsonl", []
    while run.poll() is None:
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if steps >= 1 and (not marks or steps > marks[-1][0]):
            marks.append((steps, cpu_seconds()))
        time.sleep(0.1)
    if run.returncode:
        raise subprocess.CalledProcessError(run.returncode, run.args)
    if not marks:  # no GRPO step (the warm-up run): nothing to account
        return out / name
    (first, start), (last, end) = marks[0], marks[-1]
    per_step = {role: (end[role] - start[role]) / max(last - first, 1) for role in ROLES}
    (out / name / "cpu.json").write_text(json.dumps({"steps": [first, last], "cpu_s_per_step": per_step}) + "\n")
    return out / name


def rates(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows  # the first step pays the engines' first requests

    def sampled(row: dict) -> float:
        return row["completion_tokens"] * (1.0 - row.get("observation_token_fraction", 0.0))

    per_step = [sampled(r) / r["time_generate"] for r in steady]
    cpu = json.loads((run_dir / "cpu.json").read_text())["cpu_s_per_step"]
    return {"tokens_per_s": statistics.median(per_step), "cpu_s_per_step": cpu, "turns_mean": statistics.mean(r["turns_mean"] for r in steady),
            "sampled_tokens_per_step": statistics.mean(sampled(r) for r in steady),
            "generate_s": statistics.median(r["time_generate"] for r in steady), "steps": len(steady),
            "requests": statistics.mean(r.get("agent_requests", 0.0) for r in steady),
            "engine_steps": statistics.mean(r.get("engine_steps", 0.0) for r in steady),
            "first_generate_s": rows[0]["time_generate"]}


def deepened(model: str, folder: Path, extra_layers: int) -> str:
    """`model` with `extra_layers` more transformer blocks that add nothing to its output (each
    new block's attention output projection and MLP down projection are zero, so the residual
    stream passes it unchanged): a model that samples exactly what `model` samples, and so makes
    the same tool calls, at the sampling cost of a deeper one. Checked on one prompt."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    config = base.config
    layers = config.num_hidden_layers + extra_layers
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    deep = type(base)(config)
    missing, _ = deep.load_state_dict(base.state_dict(), strict=False)
    assert all(".layers." in name for name in missing), missing
    for layer in deep.model.layers[layers - extra_layers:]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor([tokenizer("123*456=")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(base(ids).logits, deep(ids).logits, atol=1e-5), "the deepened model's output differs"
    folder.mkdir(parents=True, exist_ok=True)
    deep.save_pretrained(folder)
    for item in Path(model).iterdir():  # tokenizer, chat template, generation settings
        if item.is_file() and not item.name.startswith(("model", "config")):
            shutil.copy(item, folder / item.name)
    return str(folder)


def same_schema_agent(client, row, index):
    """examples/calculator_agent.py offering the calculator with the episode loop's own schema
    (common/tool_formats.py), so that both runs' prompts render the same tools section and the
    model makes the same kind of calls in both (bench/results/agent_throughput.md: with the
    example's own description the two runs' calls per episode differed)."""
    from common.tool_formats import tool_schemas
    from examples import calculator_agent

    calculator_agent.TOOLS = tool_schemas(["calculator"], {})
    return calculator_agent.run(client, row, index)


async def same_schema_agent_async(client, row, index):
    """`same_schema_agent` as an `async def` (the example's run_async): several episodes share
    each agent process (rollout.agent_episodes_per_process)."""
    from common.tool_formats import tool_schemas
    from examples import calculator_agent

    calculator_agent.TOOLS = tool_schemas(["calculator"], {})
    return await calculator_agent.run_async(client, row, index)


CANNED = {"id": "c", "object": "chat.completion", "created": 0, "model": "policy", "choices": [
    {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "123*456"}'}}]}}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}


def _bare_server(port: int) -> None:
    """A FastAPI app that answers every chat completion with CANNED: HTTP and JSON, nothing else."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    async def chat(session: str, request):
        json.loads(await request.body())
        return JSONResponse(CANNED)

    async def cpu():
        return {"cpu_s": time.process_time()}

    from fastapi import Request  # a real class for FastAPI to read (annotations are strings here)

    chat.__annotations__["request"] = Request
    app.post("/s/{session}/v1/chat/completions")(chat)
    app.get("/cpu")(cpu)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _floor_client(port: int, n: int, go, out) -> None:
    """`n` requests of the example's first turn, a client per request as an agent process makes
    one per episode; its CPU seconds to `out` once `go` says start (after a warm-up)."""
    import openai

    from common.tool_formats import tool_schemas

    tools, messages = tool_schemas(["calculator"], {}), [{"role": "user", "content": "123*456="}]

    def ask(i: int) -> None:
        http = openai.DefaultHttpxClient(verify=tls)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/s/{i}/v1", api_key="k", max_retries=0, http_client=http)
        client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=48)
        http.close()

    import ssl

    tls = ssl.create_default_context()
    try:
        for i in range(10):
            ask(i)
        out.put("warm")
        go.get()
        start = time.process_time()
        for i in range(n):
            ask(i)
        out.put(time.process_time() - start)
    except BaseException:
        out.put(None)  # the parent fails instead of waiting
        raise


def client_floor(processes: int, requests: int = 960) -> dict:
    """CPU per request of the `openai` client in `processes` processes at once against a bare
    server, and of that server: what HTTP costs an agent before any engine or session work."""
    import multiprocessing as mp
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = mp.get_context("spawn").Process(target=_bare_server, args=(port,), daemon=True)
    server.start()

    def server_cpu() -> float:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/cpu") as reply:
                    return json.loads(reply.read())["cpu_s"]
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the bare server did not start")

    server_cpu()
    ctx = mp.get_context("forkserver")
    gos, out = [ctx.Queue() for _ in range(processes)], ctx.Queue()
    clients = [ctx.Process(target=_floor_client, args=(port, requests // processes, go, out)) for go in gos]
    for client in clients:
        client.start()
    if None in [out.get(timeout=600) for _ in clients]:  # every client through its warm-up
        raise RuntimeError("a client process failed (its traceback is above)")
    before = server_cpu()
    for go in gos:
        go.put(True)
    spent = [out.get(timeout=600) for _ in clients]
    if None in spent:
        raise RuntimeError("a client process failed (its traceback is above)")
    client_s = sum(spent)
    server_s = server_cpu() - before
    for client in clients:
        client.join()
    server.kill()
    n = requests // processes * processes
    return {"processes": processes, "client_ms": 1000 * client_s / n, "server_ms": 1000 * server_s / n}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--output-dir", default="runs/bench")
    parser.add_argument("--model", default=None,
                        help="a model for agents already trained (a run's final_model): no warm-up run")
    parser.add_argument("--output", default=None,
                        help="the JSON result (default bench/results/agent_throughput.json; bench/results_io.py)")
    parser.add_argument("--pairs", type=int, default=3,
                        help="rounds of the runs in turn (agents then the loop, reversed every other round); "
                             "ratios are per round")
    parser.add_argument("--client-floor", action="store_true",
                        help="measure only the openai client's CPU per request against a bare server (1 and 32 processes)")
    parser.add_argument("--extra-layers", type=int, default=0,
                        help="measure with the model deepened by this many blocks that leave its output unchanged "
                             "(the same calls at a larger model's sampling cost)")
    parser.add_argument("--runs", default="agent,async agent,loop",
                        help="which of the runs, comma-separated (the loop always)")
    parser.add_argument("overrides", nargs="*", help="more grpo train overrides (every run)")
    args = parser.parse_args()
    if args.client_floor:
        for processes in (1, 32):
            floor = client_floor(processes)
            print(f"{processes:2d} client processes: openai client {floor['client_ms']:.2f} ms of CPU a request, "
                  f"bare FastAPI server {floor['server_ms']:.2f} ms")
        return
    out = Path(args.output_dir) / f"agent-throughput-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.model is None:
        warm = train(out, "warm", f"warmup.steps={args.warmup_steps}", "trainer.max_steps=0", *args.overrides)
        args.model = str(warm / "final_model")
    if args.extra_layers:
        args.model = deepened(args.model, out / "deepened_model", args.extra_layers)
    model = ["model=hf", f"model.path={args.model}", "warmup.steps=0", f"trainer.max_steps={args.steps}"]
    runs = {"agent": ["rollout.agent=bench.agent_throughput:same_schema_agent"],
            "async agent": ["rollout.agent=bench.agent_throughput:same_schema_agent_async"],
            # The chat template as the endpoint renders every request (`auto` leaves a base
            # model's plain rows as they are: the loop's model then ends each episode at once).
            "loop": ["rollout.agent=null", "rollout.tools=[calculator]", "rollout.tool_format=hermes",
                     "data.chat_template=true"]}
    chosen = set(args.runs.split(",")) | {"loop"}
    if chosen - set(runs):
        parser.error(f"--runs: unknown {', '.join(sorted(chosen - set(runs)))} (of: {', '.join(runs)})")
    runs = {name: extra for name, extra in runs.items() if name in chosen}
    agents = [name for name in runs if name != "loop"]
    from bench import results_io
    from bench.compare import Comparison

    result = results_io.Result("agent_throughput")
    rounds = []
    for pair in range(args.pairs):
        results = {}
        # The order turns each round (agents then the loop, then the loop first), so neither side
        # always runs on a machine the other has just warmed or loaded.
        for name, extra in (list(runs.items()) if pair % 2 == 0 else list(runs.items())[::-1]):
            before = load_average()
            results[name] = rates(train(out, f"{name.replace(' ', '-')}-{pair}", *model, *extra, *args.overrides))
            results[name]["load_average"] = f"{before} -> {load_average()}"
        engine = results["loop"]["cpu_s_per_step"]["generation workers"]
        for name in agents:
            # Generation is CPU-bound here: the same sampling work (the loop's workers) plus what
            # the agents' own processes spend bounds the ratio even for an endpoint that cost nothing.
            agent = results[name]
            if not agent["requests"]:
                raise RuntimeError(f"the {name} run logged no agent_requests: its episodes did not reach the endpoint")
            clients = agent["cpu_s_per_step"]["agent processes"]
            agent["ratio"] = agent["tokens_per_s"] / results["loop"]["tokens_per_s"]
            agent["ceiling_free_endpoint"] = engine / (engine + clients)
            agent["client_ms_per_request"] = 1000 * clients / agent["requests"]
            agent["server_ms_per_request"] = 1000 * (agent["cpu_s_per_step"]["generation workers"] - engine) \
                / agent["requests"]
        for name in runs:
            result.add_run({"pair": pair, "run": name, "extra_layers": args.extra_layers, **results[name]})
        rounds.append(results)
    lines = ["| round | | sampled tokens/s (median step) | generate seconds (median) | sampled tokens a step | turns "
             "per episode | HTTP requests a step | engine steps a step | CPU s a step: generation workers, agent "
             "processes | first step's generate s | load average (before -> after) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for pair, results in enumerate(rounds):
        for name in runs:
            r, cpu = results[name], results[name]["cpu_s_per_step"]
            lines.append(f"| {pair + 1} | {name} | {r['tokens_per_s']:.0f} | {r['generate_s']:.2f} "
                         f"| {r['sampled_tokens_per_step']:.0f} | {r['turns_mean']:.2f} | {r['requests']:.0f} "
                         f"| {r['engine_steps']:.0f} | {cpu['generation workers']:.2f}, {cpu['agent processes']:.2f} "
                         f"| {r['first_generate_s']:.1f} | {r['load_average']} |")
    print("\n".join(lines))
    summary = {"extra_layers": args.extra_layers, "pairs": args.pairs, "loop_tokens_per_s":
               results_io.spread(r["loop"]["tokens_per_s"] for r in rounds)}
    for name in agents:
        cmp = Comparison(a=[r[name]["tokens_per_s"] for r in rounds], b=[r["loop"]["tokens_per_s"] for r in rounds],
                         label_a=name, label_b="loop")
        summary[name] = {"comparison": cmp.summary(),
                         **{key: results_io.spread(r[name][key] for r in rounds)
                            for key in ("ceiling_free_endpoint", "client_ms_per_request", "server_ms_per_request")}}
        print(f"{cmp.sentence()}. CPU per request: agent processes "
              f"{summary[name]['client_ms_per_request']['median']:.2f} ms, generation workers beyond the loop's "
              f"{summary[name]['server_ms_per_request']['median']:.2f} ms (medians); the ratio with an endpoint "
              f"that cost nothing: {summary[name]['ceiling_free_endpoint']['median']:.2f}")
    result.write(summary, path=Path(args.output) if args.output else None)


if __name__ == "__main__":
    main()
