"""reward/sandbox.py on its own: what a sandboxed program can and cannot see or do.
(The hostile catalogue through the whole pool is in test_reward_pool.py.)"""
import os

import pytest

from common.sandbox import SandboxLimits, run_python, sandbox_problem

LIMITS = SandboxLimits(timeout_s=5)


def probe(source: str):
    """Run `source`; it passes only if it runs to the end (assertions are its verdict)."""
    return run_python(source, "pass", LIMITS)


def test_sandbox_works_here():
    assert sandbox_problem() is None


def test_passes_only_when_the_tests_run_to_their_end():
    assert run_python("def f(x):\n    return x + 1", "assert f(1) == 2", LIMITS).passed
    failed = run_python("def f(x):\n    return x", "assert f(1) == 2, 'off by one'", LIMITS)
    assert not failed.passed and not failed.timed_out and failed.error == "AssertionError: off by one"
    early = run_python("import os\nos._exit(0)", "assert False", LIMITS)
    assert not early.passed and "before the tests finished" in early.error


def test_the_callers_secrets_are_not_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    (tmp_path / "token").write_text("secret")
    home = os.path.realpath(os.path.expanduser("~"))
    assert probe("import os\nassert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE'], "
                 "sorted(os.environ)").passed
    assert probe(f"import os\nassert not os.path.exists({str(tmp_path / 'token')!r})").passed
    # the home folder is an empty tmpfs, except for the interpreter when it lives there (pyenv)
    prefix = os.path.realpath(os.sys.base_prefix)
    visible = f"{os.path.relpath(prefix, home).split(os.sep)[0]}" if prefix.startswith(home + "/") else None
    assert probe(f"import os\nassert set(os.listdir({home!r})) <= {{{visible!r}}}, os.listdir({home!r})").passed


def test_own_process_tree_network_and_working_folder():
    assert probe("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                 "assert pids == ['1'], pids").passed
    assert probe("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
                 "    raise SystemExit(3)\nexcept OSError:\n    pass").passed
    assert probe("import os\nassert os.getcwd() == '/tmp/work' and os.listdir('.') == []\n"
                 "open('scratch.txt', 'w').write('ok')").passed


@pytest.mark.skipif(os.getuid() != 0, reason="drops privileges only when started as root")
def test_runs_as_nobody_when_started_as_root():
    assert probe("import os\nassert os.getuid() == 65534 and os.getgid() == 65534").passed


def test_limits_memory_file_size_and_time():
    small = SandboxLimits(timeout_s=1.5, memory_mb=256, max_file_mb=1)
    mem = run_python("x = bytearray(512 << 20)", "pass", small)
    assert not mem.passed and mem.error == "MemoryError"
    big = run_python("open('f', 'wb').write(b'0' * (2 << 20))", "pass", small)
    assert not big.passed and not big.timed_out
    slow = run_python("import time\ntime.sleep(30)", "pass", small)
    assert slow.timed_out and not slow.passed and slow.error == "timeout"
