"""Tools: the calculator and the Python sandbox doing their job. Every failure is text for the
model, never an exception; a host that cannot sandbox is a clear setup error. The attacks on
them are in test_security_tools.py."""

import asyncio
import logging
from dataclasses import replace

import pytest

from agent_loops.tools import SandboxUnavailable, calculate, call_tool, check_sandbox, python_sandbox, run_python
from asyncrl.config.schema import SandboxConfig, ToolsConfig

FAST = SandboxConfig(cpu_s=2, wall_s=5)


@pytest.mark.parametrize("expr,expected", [
    ("3 + 4", "7"), ("-(2 - 9) * 3", "21"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"), ("7 % 3", "1"),
    ("2 ** -2", "0.25"), ("(2 ** 63) ** 16", str(2**1008)),
])
def test_calculator_evaluates_arithmetic(expr, expected):
    assert calculate(expr) == expected


@pytest.mark.parametrize("expr,error", [
    ("1 / 0", "division by zero"), ("__import__('os')", "unsupported"), ("2 ** 999999", "exponent"),
    ("3 +", "error:"), ("x + 1", "unsupported"), ("1" * 300, "longer than"), ("(2 ** 64) ** 17", "1024 bits"),
    ("(-8) ** 0.5", "complex"),
])
def test_calculator_reports_errors_as_text(expr, error):
    out = calculate(expr)
    assert out.startswith("error:") and error in out


def run(code, **limits):
    return asyncio.run(run_python(code, replace(FAST, **limits)))


def test_sandbox_runs_code_and_returns_its_output():
    assert run("print(sum(range(10)))") == "45\n"
    assert run("open('f.txt', 'w').write('hi'); print(open('f.txt').read())") == "hi\n"
    assert run("import tempfile; print(open(tempfile.mkstemp()[1], 'w').write('x'))") == "1\n"


def test_sandbox_code_runs_as_an_unprivileged_user_in_its_own_directory():
    uid, cwd = run("import os; print(os.getuid(), os.getcwd())").split()
    assert int(uid) != 0 and cwd == "/sandbox"


def test_sandbox_stops_an_infinite_loop():
    # a wall-time limit far above the CPU limit: on a loaded machine 2 s of CPU take longer
    assert run("while True: pass", wall_s=60).startswith("error: CPU-time limit of 2s exceeded")


def test_sandbox_stops_a_sleeping_process_at_the_wall_time_limit():
    assert run("import time; time.sleep(60)", wall_s=1) == "error: wall-time limit of 1s exceeded"


def test_sandbox_reports_exceptions_exit_status_and_truncates_output():
    assert run("1 / 0").startswith("error: ZeroDivisionError")
    assert run("import sys; sys.exit(3)") == "error: exit status 3\n"
    out = run("print('a' * 5000)", max_output_bytes=100)
    assert out == "a" * 100 + "\n... [output truncated at 100 bytes]"


def test_an_unisolated_sandbox_must_be_allowed_and_warns(caplog):
    with pytest.raises(SandboxUnavailable, match="allow_unisolated=true"):
        run("print(1)", isolation="none")
    python_sandbox._warn_unisolated.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert run("print(1)", isolation="none", allow_unisolated=True) == "1\n"
    assert "WITHOUT isolation" in caplog.text


def test_a_host_without_bubblewrap_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(python_sandbox, "_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailable, match="needs bubblewrap"):
        check_sandbox(SandboxConfig())
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        asyncio.run(call_tool("python", "print(1)"))  # a setup problem is not the model's: it is raised


def test_call_tool_turns_unknown_tools_and_timeouts_into_text():
    assert asyncio.run(call_tool("nope", "1")).startswith("error: unknown tool 'nope'")
    assert asyncio.run(call_tool("calculator", "2*3")) == "6"
    out = asyncio.run(call_tool("python", "import time; time.sleep(30)", ToolsConfig(timeout_s=0.5)))
    assert out == "error: tool 'python' took longer than 0.5s"
