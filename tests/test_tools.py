"""Tools: the calculator and the Python sandbox. Every failure is text for the model, never an exception."""

import asyncio
import os

import pytest

from agent_loops.tools import SandboxLimits, calculate, call_tool, run_python


@pytest.mark.parametrize("expr,expected", [
    ("3 + 4", "7"), ("-(2 - 9) * 3", "21"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"), ("7 % 3", "1"),
])
def test_calculator_evaluates_arithmetic(expr, expected):
    assert calculate(expr) == expected


@pytest.mark.parametrize("expr,error", [
    ("1 / 0", "division by zero"), ("__import__('os')", "unsupported"), ("2 ** 999999", "exponent"),
    ("3 +", "error:"), ("x + 1", "unsupported"), ("1" * 300, "longer than"),
])
def test_calculator_reports_errors_as_text(expr, error):
    out = calculate(expr)
    assert out.startswith("error:") and error in out


def run(code, **limits):
    return asyncio.run(run_python(code, SandboxLimits(**{"cpu_s": 2, "wall_s": 5, **limits})))


def test_sandbox_runs_code_and_returns_its_output():
    assert run("print(sum(range(10)))") == "45\n"
    assert run("open('f.txt', 'w').write('hi'); print(open('f.txt').read())") == "hi\n"


def test_sandbox_stops_an_infinite_loop():
    assert run("while True: pass").startswith("error: CPU-time limit of 2s exceeded")


def test_sandbox_stops_a_sleeping_process_at_the_wall_time_limit():
    assert run("import time; time.sleep(60)", wall_s=1) == "error: wall-time limit of 1s exceeded"


def test_sandbox_contains_a_memory_bomb():
    out = run("x = bytearray(8 * 2**30)", memory_mb=256)
    assert out.startswith("error: MemoryError")


def test_sandbox_blocks_the_network():
    out = run("import socket; socket.create_connection(('127.0.0.1', 9))")
    assert out.startswith("error: PermissionError: sandbox: socket.")


def test_sandbox_blocks_writes_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    out = run(f"open({str(target)!r}, 'w').write('x')")
    assert out.startswith("error: PermissionError: sandbox: writing outside the working directory")
    assert not target.exists()
    out = run(f"import os; os.remove({str(tmp_path)!r})")
    assert "outside the working directory" in out and tmp_path.exists()


def test_sandbox_blocks_subprocesses():
    assert run("import os; os.system('true')").startswith("error: PermissionError: sandbox: os.system")
    assert "sandbox: subprocess.Popen" in run("import subprocess; subprocess.run(['true'])")


def test_sandbox_reports_exceptions_and_truncates_output():
    assert run("1 / 0").startswith("error: ZeroDivisionError")
    out = run("print('a' * 5000)", max_output_chars=100)
    assert out.startswith("a" * 100) and "output truncated" in out and len(out) < 200


def test_sandbox_environment_is_empty():
    os.environ["ASYNCRL_SECRET_FOR_TEST"] = "s3cret"
    try:
        assert "s3cret" not in run("import os; print(dict(os.environ))")
    finally:
        del os.environ["ASYNCRL_SECRET_FOR_TEST"]


def test_call_tool_turns_unknown_tools_and_timeouts_into_text():
    assert asyncio.run(call_tool("nope", "1")).startswith("error: unknown tool 'nope'")
    assert asyncio.run(call_tool("calculator", "2*3")) == "6"
    out = asyncio.run(call_tool("python", "import time; time.sleep(30)", timeout_s=0.5))
    assert out == "error: tool 'python' took longer than 0.5s"
