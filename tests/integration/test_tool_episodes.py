"""Multi-turn episodes on a real vLLM engine with real tools and the real sandbox.

The built-in model is first made to memorise a few tool-using traces (plain PyTorch, seconds),
so that greedy decoding really writes the calls: a calculator call, and the hostile programs a
model could write for the python tool (a busy loop, a fork bomb, reading the caller's files and
environment, a socket to loopback, a gigabyte of output). Each is then generated, parsed and run
by the generation worker as in training, and what comes back is checked.
"""
from __future__ import annotations

import ast
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.sandbox import _hidden_paths, _kept_paths
from helpers import EngineTap, release_in_process_engine, seeded

HOME = os.path.realpath(os.path.expanduser("~"))
SECRET_FILE = f"/tmp/gs{os.getpid()}"


def cases() -> dict:
    """prompt -> (tool, arguments): what the memorised model calls for it."""
    return {
        "c1=": ("calculator", "123*456"),
        "h1=": ("python", "while 1: pass"),
        "h2=": ("python", "import os\nwhile 1: os.fork()"),
        "h3=": ("python", f"print(open('{SECRET_FILE}').read())"),
        "h4=": ("python", f"import os;print(os.listdir('{HOME}'))"),
        "h5=": ("python", "import os;print(sorted(os.environ))"),
        "h6=": ("python", "import socket;socket.socket().connect(('127.0.0.1',9))"),
        "h7=": ("python", "for i in range(10**4):print('x'*10**5)"),
    }


@pytest.fixture(scope="module")
def tool_model(system_cfg, tmp_path_factory) -> str:
    """The built-in model, trained until greedy decoding reproduces every case's trace."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tool_formats import TagFormat

    tokenizer = AutoTokenizer.from_pretrained(system_cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(system_cfg.model.path)
    fmt = TagFormat()
    rows = []
    for prompt, (tool, arguments) in cases().items():
        segments = [("<think>" + fmt.call_text(tool, arguments), True), (fmt.observation_text("0"), False),
                    ("</think><answer>0</answer>", True)]
        ids, mask = tokenizer(prompt)["input_ids"], []
        mask = [0] * len(ids)
        for text, trained in segments:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, mask = ids + piece, mask + [int(trained)] * len(piece)
        rows.append((ids + [tokenizer.eos_token_id], mask + [1]))
    length = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r[0] + [0] * (length - len(r[0])) for r in rows])
    mask = torch.tensor([r[1] + [0] * (length - len(r[1])) for r in rows], dtype=torch.bool)[:, 1:]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(1500):
        logprobs = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    folder = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def worker(tool_model):
    from common.config import RolloutConfig
    from rollout.worker import GenerationWorker

    Path(SECRET_FILE).write_text("hunter2")
    os.environ["GRPO_SECRET"] = "hunter2"  # the engine runs in this process: the tools inherit it
    # 6 s: a gigabyte of output takes about 1.5 s alone, more beside a busy test suite
    cfg = RolloutConfig(tools=["calculator", "python"], max_turns=2, max_new_tokens=80, max_model_len=128,
                        kv_cache_gib=0.25, tool_timeout_s=6.0, tool_max_output_chars=100,
                        enforce_eager=True, dtype="float32")
    worker = GenerationWorker(tool_model, cfg, seed=0)
    yield worker
    # The worker's tool threads and sandboxes live in this (the test) process: a later test of
    # this worker process counts what is left of them (tests/unit/test_tools.py).
    worker.tools.close()
    release_in_process_engine(worker)
    os.environ.pop("GRPO_SECRET", None)
    Path(SECRET_FILE).unlink(missing_ok=True)


def generate(worker, prompts, n=1, greedy=True):
    batch = [(i, p, "0", {}) for i, p in enumerate(prompts)]
    *groups, report = worker.generate(*seeded(batch, range(len(batch))), n=n, greedy=greedy)
    return groups, report.stats


def observation(group) -> str:
    """The first tool result of the group's first episode."""
    transcript = group.transcripts[0]
    return transcript[transcript.index("<result>") + len("<result>"): transcript.index("</result>")]


def test_the_model_calls_the_calculator_and_reads_its_result(worker):
    (group,), stats = generate(worker, ["c1="])
    assert group.completions[0].startswith("<think><tool>calculator: 123*456</tool>")
    assert "<result>" not in group.completions[0]  # verifiers get the model's own text
    assert observation(group) == "56088"
    assert stats["tool_calls"] == 1 and stats["tool_errors"] == 0 and stats["turns"] == 2
    # one episode alone: an engine step for each sampled token of its two turns, and no more
    assert stats["engine_steps"] == sum(group.loss_masks[0])
    # the next turn's request repeats the context so far: vLLM's prefix cache serves it
    assert worker.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


def test_hostile_tool_calls_are_contained_by_the_sandbox(worker):
    prompts = [p for p in cases() if p.startswith("h")]
    groups, stats = generate(worker, prompts)
    seen = {p: observation(g) for p, g in zip(prompts, groups)}
    for prompt, group in zip(prompts, groups):  # the model really wrote each call
        assert group.completions[0].startswith(f"<think><tool>python: {cases()[prompt][1]}</tool>"), prompt
    assert seen["h1="].startswith("error: timed out")                          # a busy loop
    assert seen["h2="].startswith(("error:", "BlockingIOError"))               # a fork bomb: stopped
    assert "FileNotFoundError" in seen["h3="] and "hunter2" not in seen["h3="]  # /tmp is empty in there
    # the caller's home is empty but for the interpreter's own folder when it lives there (pyenv)
    interpreter = [os.path.relpath(p, HOME).split("/")[0] for p in _kept_paths(_hidden_paths())]
    assert ast.literal_eval(seen["h4="].strip()) == interpreter
    assert "GRPO_SECRET" not in seen["h5="] and "PATH" in seen["h5="]          # a clean environment
    assert "Error" in seen["h6="]                                              # no network
    assert seen["h7="].startswith("x" * 100) and "more characters]" in seen["h7="]  # 1 GB, cut
    assert len(seen["h7="]) < 200
    assert stats["tool_calls"] == len(prompts) and stats["tool_timeouts"] >= 1
    # Ours: started under this process (the engine and its tools run here), or orphaned (an
    # escaped child is re-parented to pid 1). The other test worker's verifier sandboxes are
    # neither, and may be running right now.
    # A call the box stopped waiting for is ended by the sandbox's own limit a moment later
    # (beside a busy suite, after generate returned): allow that, not a process that stays.
    deadline = time.monotonic() + 10.0
    while (leftovers := _our_sandboxes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers, "sandbox processes outlived their calls"


def _our_sandboxes() -> list:
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_sandbox(pid)
            and (_descends_from(int(pid), os.getpid()) or _parent(int(pid)) == 1)]


def _parent(pid: int) -> int:
    try:  # the field after the command name, which may itself hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _parent(pid)
    return False


def _is_sandbox(pid: str) -> bool:
    try:
        return b"unshare" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_the_learner_trains_on_exactly_the_ids_the_sampler_produced(worker):
    """Token in, token out: each turn's prompt is the episode's ids so far (never re-tokenized
    text), every sampled id reaches the learner's batch as a target, every tool-result id is
    in its context but not a target."""
    from learner.batching import flatten

    tap = EngineTap(worker.llm.llm_engine)
    worker.llm.llm_engine = tap
    try:
        groups, stats = generate(worker, ["c1=", "h5="], n=3, greedy=False)
    finally:
        worker.llm.llm_engine = tap.engine
    assert stats["tool_calls"] >= 1 and stats["observation_tokens"] > 0
    turns = sorted(tap.sampled, key=lambda rid: tuple(int(x) for x in rid.split("-")[1:]))
    for k, group in enumerate(groups):
        for j, (ids, mask) in enumerate(zip(group.completion_ids, group.loss_masks)):
            prompt, targets = group.prompt_ids, []
            for rid in (r for r in turns if int(r.split("-")[1]) == k * 3 + j):  # this episode's turns
                context = tap.prompts[rid]
                assert context[:len(prompt)] == prompt and context[len(prompt):] == ids[:len(context) - len(prompt)]
                start = len(context) - len(prompt)
                sampled = tap.sampled[rid][0]
                assert ids[start:start + len(sampled)] == sampled
                targets += range(start, start + len(sampled))
            # the sampled ids are exactly the targets; every other id is a tool result's
            assert [i for i, m in enumerate(mask) if m] == targets
            assert len(group.sampler_logprobs[j]) == len(ids)
    scored = [replace(g, rewards=[0.0] * g.group_size) for g in groups]
    batch = flatten(scored, pad_id=0, device="cpu")
    row = 0
    for group in scored:
        for ids, mask in zip(group.completion_ids, group.loss_masks):
            start = len(group.prompt_ids)
            assert batch.ids[row, start:start + len(ids)].tolist() == ids
            trained = batch.mask[row, start - 1:start - 1 + len(ids)].tolist()
            assert trained == [bool(m) for m in mask]
            row += 1
