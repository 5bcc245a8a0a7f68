"""Hostile and broken completions for the verifier pool (tests/integration/test_reward_pool.py and
bench/hostile_inputs.py). Each case attacks one verifier and says what must come out."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

HOME = os.path.realpath(os.path.expanduser("~"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
F_TESTS = "assert f() == 1"
GOOD_CODE = "<think>easy</think><answer>```python\ndef f():\n    return 1\n```</answer>"

BUILTIN = dict(verifiers=["math", "format", "code", "language", "length"],
               weights={"math": 1.0, "format": 0.1, "code": 1.0, "language": 0.1, "length": 0.1})
CUSTOM = dict(verifiers=["format", "hang", "exits", "nan", "crash"],
              weights={"format": 1.0, "hang": 1.0, "exits": 1.0, "nan": 1.0, "crash": 1.0},
              format_pattern=r"<answer>(\d+)+</answer>",  # a user's regex with nested quantifiers
              custom={"hang": "hostile_verifiers:hang_in_c", "exits": "hostile_verifiers:exits",
                      "nan": "hostile_verifiers:not_a_number", "crash": "hostile_verifiers:crashes"})
CUSTOM_SEARCH_PATH = [TESTS]  # where hostile_verifiers.py is

CONTROL = {
    "builtin": ("<think>1</think><answer>1</answer>", "1", {}),
    "code": (GOOD_CODE, "1", {"tests": F_TESTS}),
    "custom": ("<answer>1</answer>", "1", {}),
}
"""A completion each pool must still score 1 on (for the attacked verifier) right after a case."""


@dataclass(frozen=True)
class Case:
    name: str
    pool: str
    """`builtin` or `custom` (which settings above)."""
    verifier: str
    completion: str
    answer: str = "1"
    fields: Dict[str, str] = field(default_factory=dict)
    score: Optional[float] = 0.0
    """The attacked verifier's expected score (None: any)."""
    timeout: Optional[bool] = None
    """True: must be counted as a timeout; False: must not; None: either."""
    error: bool = False
    """True: the verifier must report an error (scored 0)."""
    absent: List[str] = field(default_factory=list)
    """Paths that must not exist on this machine afterwards."""

    @property
    def control(self):
        return CONTROL["code" if self.verifier == "code" else self.pool]


def program(source: str) -> str:
    return f"<think>x</think><answer>```python\n{source}\n```</answer>"


def cases(port: int, tag: str) -> List[Case]:
    """`port`: a TCP port listening on 127.0.0.1; `tag`: unique text for files that must not appear."""
    escape = [f"/tmp/escape-{tag}", f"{REPO}/escape-{tag}", f"{HOME}/escape-{tag}", f"/var/tmp/escape-{tag}"]
    writes = "\n".join(f"try:\n    open({p!r}, 'w').write('x')\nexcept OSError:\n    pass" for p in escape)
    nested = "<answer>" + "\\sqrt{" * 100 + "2" + "}" * 100 + "</answer>"
    frac_bomb = "<answer>" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "</answer>"
    return [
        # ---- math / format / text
        Case("1 MB completion", "builtin", "math", "<think>" + "a" * 1_000_000 + "</think><answer>2</answer>"),
        Case("1 MB answer", "builtin", "math", "<answer>" + "9" * 1_000_000 + "</answer>"),
        Case("deeply nested LaTeX", "builtin", "math", nested),
        Case("\\frac bomb", "builtin", "math", frac_bomb),
        Case("10^{10^{10}}", "builtin", "math", "<answer>10^{10^{10}}</answer>"),
        Case("power tower vs its own gold", "builtin", "math", "<answer>2^{2^{2^{2^{2^{2}}}}}</answer>",
             answer="3"),
        Case("empty completion", "builtin", "math", ""),
        Case("empty completion (format)", "builtin", "format", ""),
        Case("invalid UTF-8, answer intact", "builtin", "math",
             b"\xff\xfe\xc3<think>x</think><answer>1</answer>".decode("utf-8", "surrogateescape"), score=1.0,
             timeout=False),
        Case("NUL bytes and control characters", "builtin", "math", "<answer>\x00\x1b[2J\x07</answer>",
             timeout=False),
        Case("answer hidden in nonsense reasoning", "builtin", "format",
             "qwer zxcv <answer>1</answer> asdf <think>lorem</think>", timeout=False),
        Case("text between the blocks", "builtin", "format",
             "<think>x</think> by the way <answer>1</answer>", timeout=False),
        Case("two answer blocks", "builtin", "format",
             "<think>x</think><answer>2</answer><answer>1</answer>", timeout=False),
        Case("tag soup", "builtin", "format", "<think>" * 100_000 + "</answer>" * 100_000, timeout=False),
        Case("regex backtracking bait for the built-ins", "builtin", "math",
             "<answer>1 " + "aaa " * 50_000 + "!</answer>", timeout=False),
        # ---- code: the sandbox
        Case("correct program with a flood of output", "builtin", "code",
             program("print('x' * 10**7)\ndef f():\n    return 1"), fields={"tests": F_TESTS}, score=1.0,
             timeout=False),
        Case("syntax error", "builtin", "code", program("def f(:\n    return 1"), fields={"tests": F_TESTS},
             timeout=False),
        Case("infinite loop", "builtin", "code", program("while True:\n    pass"), fields={"tests": F_TESTS},
             timeout=True),
        Case("fork bomb", "builtin", "code",
             program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
             fields={"tests": F_TESTS}),
        Case("allocate 10 GB", "builtin", "code", program("x = bytearray(10 * 1024**3)\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("write a 100 MB file", "builtin", "code",
             program("open('big', 'wb').write(b'0' * (100 << 20))\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("write files outside its folder", "builtin", "code", program(writes + "\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, score=None, absent=escape),
        Case("read the environment's secrets", "builtin", "code",
             program("import os\nleaked = [k for k in os.environ if k.startswith(('RAY', 'VLLM', 'WANDB', "
                     "'TOKENIZERS', 'AWS', 'HF_', 'GRPO'))]\nassert leaked, 'clean'\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("read ~/.ray and Ray's session folder", "builtin", "code",
             program(f"import glob\nfound = glob.glob({HOME + '/.ray/*'!r}) + glob.glob('/tmp/ray/*')\n"
                     f"assert found, 'hidden'\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("open a socket to 127.0.0.1", "builtin", "code",
             program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                     f"def f():\n    return 1"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("kill its parent", "builtin", "code",
             program("import os, signal\nfor pid in range(1, 4096):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                     "    except OSError:\n        pass\ndef f():\n    return 1"),
             fields={"tests": F_TESTS}, score=None),
        Case("sys.exit(0) before the tests", "builtin", "code", program("import sys\nsys.exit(0)"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("os._exit(0) before the tests", "builtin", "code", program("import os\nos._exit(0)"),
             fields={"tests": F_TESTS}, timeout=False),
        Case("tamper with signal handlers", "builtin", "code",
             program("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU, signal.SIGALRM, "
                     "signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass"),
             fields={"tests": F_TESTS}, timeout=True),
        Case("escape into a new session and sleep", "builtin", "code",
             program("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n"
                     "def f():\n    return 1"),
             fields={"tests": F_TESTS}, score=1.0, timeout=False),
        # ---- a user's own regex and verifiers
        Case("catastrophic backtracking in format_pattern", "custom", "format",
             "<answer>" + "1" * 40 + "x</answer>", timeout=True),
        Case("custom verifier stuck in C code", "custom", "hang", "HANG", timeout=True),
        Case("custom verifier calls sys.exit", "custom", "exits", "EXIT", error=True),
        Case("custom verifier returns NaN", "custom", "nan", "NAN", error=True),
        Case("custom verifier segfaults", "custom", "crash", "CRASH", error=True),
    ]
