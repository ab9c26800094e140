"""The built-in environments, for real: the calculator's evaluator and bounds; the Python sandbox (normal output,
exceptions, a hang, a memory bomb, a segfault, endless printing, a child process left behind: each becomes an
observation, the caller never raises or hangs); OpenEnv's echo environment (generated from openenv-core's own
template) run in-process through the adapter; EnvConfig and the factory registry."""
from __future__ import annotations

import os
import sys
import time

import pytest

from megatron_dppo.env.calculator import CalculatorEnv, CalculatorError, evaluate, format_value
from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.protocol import MalformedStep, Step, Task, Turn, check_step
from megatron_dppo.env.python_tool import PythonToolEnv
from megatron_dppo.env.registry import BUILTIN_ENVS, make_env_factory, resolve_env_factory
from megatron_dppo.env.sandbox import run_python


def turn(text: str, index: int = 0) -> Turn:
    return Turn(index=index, token_ids=(1, 2), text=text, finish_reason="stop")


# ------------------------------------------------------------------------------------------------------------
# calculator
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [("12*34", 408), ("123456789 * 987654321", 121932631112635269),
                                               ("(2+3)**3 - -4", 129), ("7/2", 3.5), ("7//2", 3), ("2**-1", 0.5),
                                               ("10 % 4", 2), ("1.5*4", 6.0)])
def test_calculator_evaluates(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [("1/0", "division by zero"), ("2**1000", "exponent"),
                                                 ("10**60 * 10**10", "digits"), ("9**9**9", "exponent|digits"),
                                                 ("__import__('os')", "unsupported"), ("x+1", "unsupported"),
                                                 ("1+", "parse"), ("'a'*3", "unsupported"),
                                                 ("10**64 * 10**64", "digits")])
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_calculator_env_answers_each_call_and_ends_without_one():
    env = CalculatorEnv()
    assert env.reset(Task("t"), 0) == []
    step = env.step(turn("first <calc>12*34</calc> then <calc>1/0</calc> and <calc>7/2</calc>"))
    assert step.messages == [{"role": "tool", "content": "408\nerror: division by zero\n3.5"}]
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 3, 1)
    assert env.step(turn("The answer is 408.")).done
    assert env.step(turn("<calc>1+1")).done  # an unclosed call is no call
    many = CalculatorEnv(max_calls=1).step(turn("<calc>1</calc><calc>2</calc>"))
    assert many.messages[0]["content"] == "1\nerror: at most 1 calculations per turn" and many.tool_errors == 1
    assert format_value(6.0) == "6" and format_value(0.1) == "0.1"
    check_step(step)


# ------------------------------------------------------------------------------------------------------------
# Python sandbox
# ------------------------------------------------------------------------------------------------------------
def test_sandbox_runs_code_and_reports_errors():
    ok = run_python("print(sum(range(10)))", timeout_s=30)
    assert (ok.stdout, ok.returncode, ok.ok, ok.timed_out) == ("45\n", 0, True, False)
    err = run_python("raise ValueError('bad')", timeout_s=30)
    assert err.returncode == 1 and "ValueError: bad" in err.stderr and not err.ok
    isolated = run_python("import os, sys; print(os.getcwd(), 'PYTHONPATH' in os.environ, sys.flags.isolated, "
                          "os.listdir('.'))", timeout_s=30)
    assert isolated.stdout.split() == ["/tmp", "False", "1", "[]"] and isolated.limits in ("cgroup", "rlimit")
    legacy = run_python("import os; print(os.getcwd().split('/')[-1].startswith('dppo-tool-'))", timeout_s=30,
                        isolation="none")
    assert legacy.stdout.split() == ["True"] and legacy.limits == "none"


def test_sandbox_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_python("import time\nwhile True: time.sleep(0.1)", timeout_s=1.0)
    assert result.timed_out and result.returncode is None and result.signal_name == "SIGKILL"
    assert time.monotonic() - start < 5


def test_sandbox_child_processes_do_not_outlive_the_call_without_isolation(tmp_path):
    """isolation=none still kills the call's process group (under bwrap the code cannot write the host path; the
    same property, daemons included, is in test_sandbox_hostile.py)."""
    marker = tmp_path / "pid"
    code = ("import os, subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(marker)!r}, 'w').write(str(p.pid))\nprint('started')\n")
    result = run_python(code, timeout_s=30.0, isolation="none")
    assert result.stdout == "started\n", result
    pid = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by init) counts as gone
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"child process {pid} outlived the sandbox call")


def test_sandbox_limits_memory_cpu_and_output():
    memory = run_python("x = bytearray(2 * 1024**3)", memory_mb=256, timeout_s=30)
    assert "MemoryError" in memory.stderr and not memory.ok
    flood = run_python("while True: print('x' * 1000)", max_output_bytes=10000, timeout_s=30)
    assert "File too large" in flood.stderr and len(flood.stdout) <= 10000 and not flood.ok
    cpu = run_python("while True: pass", cpu_s=1, timeout_s=30)
    assert cpu.signal_name in ("SIGXCPU", "SIGKILL") and not cpu.timed_out
    crash = run_python("import ctypes; ctypes.string_at(0)", timeout_s=30)
    assert crash.signal_name == "SIGSEGV"


def test_python_tool_turns_every_failure_into_an_observation():
    env = PythonToolEnv(timeout_s=30.0)  # generous: a loaded machine starts interpreters slowly
    step = env.step(turn("<python>print(6*7)</python>"))
    assert step.messages == [{"role": "tool", "content": "42"}] and (step.tool_calls, step.tool_errors) == (1, 0)
    hang = PythonToolEnv(timeout_s=1.0).step(turn("<python>import time; time.sleep(30)</python>"))
    assert "TimeoutError" in hang.messages[0]["content"] and hang.tool_timeouts == 1 and not hang.done
    crash = env.step(turn("<python>import ctypes; ctypes.string_at(0)</python>"))
    assert "SIGSEGV" in crash.messages[0]["content"] and crash.tool_errors == 1
    error = env.step(turn("<python>1/0</python>"))
    assert "ZeroDivisionError" in error.messages[0]["content"] and error.tool_errors == 1
    assert env.step(turn("no code here")).done
    for s in (step, hang, crash, error):
        check_step(s)


def test_print_last_answers_a_final_expression_like_a_notebook_cell():
    assert run_python("x = 3\nx * 4", print_last=True, timeout_s=30).stdout == "12\n"
    assert run_python("48*97", print_last=True, timeout_s=30).stdout == "4656\n"
    assert run_python("print('a')", print_last=True, timeout_s=30).stdout == "a\n"  # None is not printed
    assert run_python("48*97", timeout_s=30).stdout == ""  # off: a script, as python runs it
    error = run_python("1/0", print_last=True, timeout_s=30)
    assert "ZeroDivisionError" in error.stderr and 'File "<tool>", line 1' in error.stderr
    env = PythonToolEnv(tag="calc", max_calls=1, print_last=True, timeout_s=30.0)
    assert env.step(turn("<calc>48*97</calc>")).messages == [{"role": "tool", "content": "4656"}]


def test_a_calls_cpu_seconds_are_counted_though_bubblewrap_reaps_its_processes():
    from megatron_dppo.env import sandbox

    before = sandbox.cpu_seconds_total()
    busy = run_python("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass",
                      timeout_s=30)
    if busy.limits != "cgroup":
        pytest.skip("CPU accounting needs a control group")
    assert busy.cpu_s is not None and busy.cpu_s >= 0.3
    assert sandbox.cpu_seconds_total() - before >= 0.3


def test_the_step_cpu_clock_charges_sandboxed_calls():
    """train.cpu_budget_s charges the whole step, tools included: a call's processes are reaped inside bubblewrap's
    pid namespace (never by the trainer), so the clock reads the calls' control groups."""
    from megatron_dppo.run.metrics import PhaseTimer

    timer = PhaseTimer()
    busy = run_python("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass",
                      timeout_s=30)
    if busy.limits != "cgroup":
        pytest.skip("CPU accounting needs a control group")
    assert timer.step_cpu_seconds() >= 0.4


def test_python_tool_options_are_checked():
    with pytest.raises(ValueError, match="isolation must be one of"):
        PythonToolEnv(isolation="docker")
    with pytest.raises(ValueError, match="scratch_mb"):
        PythonToolEnv(scratch_mb=0)


def test_a_sandbox_that_cannot_start_raises(monkeypatch):
    """The one failure that is not an observation (the episode loop turns it into an env_error finish): a missing
    interpreter, and bubblewrap failing to set up a call mid-run (here: a mount whose source vanished)."""
    with pytest.raises(OSError):
        run_python("print(1)", python="/nonexistent/python3")
    import megatron_dppo.env.bubblewrap as bubblewrap
    from megatron_dppo.env.sandbox import SandboxError

    assert run_python("pass", timeout_s=30).ok  # the start-up check passed (and is cached): a later call fails
    real = bubblewrap.command
    monkeypatch.setattr(bubblewrap, "command", lambda *a, **k: real(*a, **k)[:1] + [
        "--ro-bind", "/nonexistent-dppo-mount", "/x"] + real(*a, **k)[1:])
    with pytest.raises(SandboxError, match="bubblewrap did not start the call.*nonexistent-dppo-mount"):
        run_python("print(1)", timeout_s=30)


# ------------------------------------------------------------------------------------------------------------
# OpenEnv (openenv-core): the echo environment of its template, in-process
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def echo_env_package(tmp_path_factory):
    pytest.importorskip("openenv", reason="pip install openenv-core")
    from openenv.cli.commands.init import _copy_template_directory, _create_template_replacements

    root = tmp_path_factory.mktemp("openenv")
    _copy_template_directory("openenv.cli.templates.openenv_env", "", root / "echo_env",
                             _create_template_replacements("echo_env"), "echo_env")
    sys.path.insert(0, str(root))
    yield "echo_env"
    sys.path.remove(str(root))
    for name in [n for n in sys.modules if n == "echo_env" or n.startswith("echo_env.")]:
        del sys.modules[name]


@pytest.mark.slow  # importing openenv-core imports gradio: ~15 s
def test_openenv_echo_environment_in_process(echo_env_package):
    kwargs = dict(environment="echo_env.server.echo_env_environment:EchoEnvironment",
                  action="echo_env.models:EchoAction", action_field="message", observation_field="echoed_message")
    build = make_env_factory("openenv", kwargs)
    env = build()
    assert env.reset(Task("t"), 3) == []
    step = check_step(env.step(turn("hello")))
    assert step.messages == [{"role": "user", "content": "hello"}]
    assert step.reward == pytest.approx(0.5) and not step.done  # the echo env rewards 0.1 per character
    shown = build.__call__()
    shown.show_reset = True
    assert shown.reset(Task("t"), 0)[0]["content"] == "Echo Env environment ready!"
    as_json = make_env_factory("openenv", {**kwargs, "observation_field": None})()
    assert as_json.step(turn("hi")).messages[0]["content"] == '{"echoed_message": "hi", "message_length": 2}'
    with pytest.raises(ValueError, match="has no field 'text'"):
        make_env_factory("openenv", {**kwargs, "action_field": "text"})


# ------------------------------------------------------------------------------------------------------------
# Config and registry
# ------------------------------------------------------------------------------------------------------------
class CountingEnv:
    built = 0

    def __init__(self, limit=2):
        CountingEnv.built += 1
        self.limit = limit

    def reset(self, task, seed):
        return []

    def step(self, turn):
        return Step(done=turn.index + 1 >= self.limit, messages=[{"role": "user", "content": "again"}])


def test_registry_builds_builtins_and_import_paths():
    assert set(BUILTIN_ENVS) == {"noop", "calculator", "python", "openenv"}
    assert resolve_env_factory("calculator") is CalculatorEnv
    build = make_env_factory(f"{__name__}:CountingEnv", {"limit": 3})
    before = CountingEnv.built
    env = build()
    assert CountingEnv.built == before + 1 and env.limit == 3
    with pytest.raises(ValueError, match="unknown environment 'calc'.*built-in"):
        resolve_env_factory("calc")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_env_factory("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        resolve_env_factory(f"{__name__}:Nope")
    with pytest.raises(ValueError, match="rejects env.kwargs"):
        make_env_factory("calculator", {"bogus": 1})
    with pytest.raises(ValueError, match="without a reset"):
        make_env_factory("builtins:object")


@pytest.mark.parametrize("field, value, message", [
    ("name", "", "env.name"), ("max_turns", 0, "env.max_turns"), ("max_tokens", 1.5, "env.max_tokens"),
    ("max_assistant_tokens", 0, "max_assistant_tokens"), ("max_assistant_tokens", 5000, "exceeds env.max_tokens"),
    ("step_timeout_s", 0, "step_timeout_s"), ("token_check", "loose", "token_check"), ("kwargs", [], "env.kwargs"),
])
def test_env_config_names_the_bad_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        EnvConfig(**{"name": "calculator", field: value})


def test_env_config_defaults():
    cfg = EnvConfig(name="calculator")
    assert cfg.assistant_token_limit == cfg.max_tokens == 1024
    assert EnvConfig(name="x:Y", max_assistant_tokens=100).assistant_token_limit == 100


def test_step_validation():
    with pytest.raises(MalformedStep, match="must return a Step"):
        check_step({"done": True})
    with pytest.raises(MalformedStep, match="finite"):
        check_step(Step(done=True, reward=float("nan")))
    with pytest.raises(MalformedStep, match="role"):
        check_step(Step(messages=[{"role": "assistant", "content": "x"}]))
    with pytest.raises(MalformedStep, match="without observation"):
        check_step(Step())
    with pytest.raises(MalformedStep, match="tool_errors"):
        check_step(Step(done=True, tool_errors=-1))
