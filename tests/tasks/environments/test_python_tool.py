"""The python tool against hostile and ordinary programs, called as the model calls it (a rollout's environment,
``RolloutTools.python``): every program really runs in the sandbox. A hostile program gets an error answer (or
its output cut) and contains nothing; the rollout goes on, and the next ordinary call answers as Python would.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tasks.config import ToolSettings
from tasks.environments import Toolbox

SECRET = "grpoflow-tool-secret-5d1e"
LIMITS = {"timeout_s": 3, "cpu_seconds": 2, "memory_mb": 128, "output_bytes": 512}


def toolbox(session: bool = False) -> Toolbox:
    settings = {"max_calls": 50, "max_seconds": 300, "max_output_bytes": 100_000, "session": session}
    return Toolbox(ToolSettings(use=[{"name": "python", "args": LIMITS}], **settings))


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_hostile_calls_answer_with_an_error_and_the_rollout_goes_on(
    listener, isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bubblewrap and under the ``unshare`` path's private root alike. The host folder is under /tmp, where
    any user could reach it if the sandbox saw the host's tree."""
    monkeypatch.setenv("GRPOFLOW_SANDBOX", isolation)
    port, accepted = listener
    host_folder = Path(tempfile.mkdtemp(prefix="grpoflow-tool-host-", dir="/tmp"))
    host_folder.chmod(0o777)
    secret_file = host_folder / "secret.txt"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    (host_folder / "keep.txt").write_text("keep")
    hostile = {
        "network to the host": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
        "network to the internet": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
        "a host file": f"print(open({str(secret_file)!r}).read())",
        "a host file, listed": f"import os\nprint(os.listdir({str(host_folder)!r}))",
        "a host file, deleted": f"import os\nos.remove({str(host_folder / 'keep.txt')!r})",
        "a host file, written": f"open({str(host_folder / 'new.txt')!r}, 'w').write('x')",
        "the parent's /proc": f"print(open('/proc/{os.getpid()}/environ').read())",
        "endless loop": "while True:\n    pass",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))",
        "kill the parent": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nos.kill(os.getppid(), 9)",
        "exit before the end": "import sys\nprint('bye')\nsys.exit(0)",
    }
    environment = toolbox().factory()
    environment.reset()
    answers = {}
    for name, code in hostile.items():
        started = time.monotonic()
        answer = answers[name] = environment.python(code)
        record = environment.tool_calls[-1]
        assert record.failed and answer.count("Error") >= 1, (name, answer)
        assert SECRET not in answer and "secret.txt" not in answer, name
        assert time.monotonic() - started < LIMITS["timeout_s"] + 10, name
        # the rollout goes on: the next call answers
        assert environment.python("print(6 * 7)") == "42", name
    assert accepted == []
    assert "ran past its time limit" in answers["endless loop"]
    assert "out of memory" in answers["memory bomb"]
    assert sorted(os.listdir(host_folder)) == ["keep.txt", "secret.txt"]  # nothing deleted, nothing written
    shutil.rmtree(host_folder)


def test_a_flood_is_cut_at_the_tools_output_limit_and_said_so() -> None:
    environment = toolbox().factory()
    answer = environment.python("while True:\n    print('A' * 1000)")
    assert f"[output cut at {LIMITS['output_bytes']} bytes]" in answer
    assert len(answer.encode()) < LIMITS["output_bytes"] + 200


def test_ordinary_programs_answer_as_python_would() -> None:
    ordinary = {
        "def f(n):\n    return n * n\nprint(f(12))": "144",
        "sum(range(10))": "45",
        "import math, fractions\nprint(math.comb(10, 3), fractions.Fraction(3, 6))": "120 1/2",
        "2 ** 100": "1267650600228229401496703205376",
        "print('π ≈', round(3.14159, 2))": "π ≈ 3.14",
        "print('''a\"b'c\\\\n''')": "a\"b'c\\n",
        # what it printed, then what it wrote to stderr
        "import sys\nprint('note', file=sys.stderr)\nprint(5)": "5\nnote",
        "x = [i * i for i in range(5)]\nx": "[0, 1, 4, 9, 16]",
        "'text'": "'text'",
        "import json\nprint(json.dumps({'a': [1, 2]}))": '{"a": [1, 2]}',
        "x = 3": "[no output: print what you need]",
        "for i in range(3):\n    print(i)": "0\n1\n2",
    }
    environment = toolbox().factory()
    for code, expected in ordinary.items():
        assert environment.python(code) == expected, code
        assert not environment.tool_calls[-1].failed, code


def test_a_programs_own_error_is_its_answer() -> None:
    environment = toolbox().factory()
    assert environment.python("1 / 0") == "Error: ZeroDivisionError: division by zero"
    answer = environment.python("print(1\nprint(2)")
    assert answer.startswith("Error: SyntaxError") and environment.tool_calls[-1].kind == "error"
    assert environment.python("print('before')\nraise ValueError('bad')").startswith("before\nError: ValueError")


def test_a_session_keeps_a_rollouts_names_and_a_reset_or_no_session_does_not() -> None:
    environment = toolbox(session=True).factory()
    environment.reset()
    assert environment.python("x = 41\nprint('set')") == "set"
    assert environment.python("x + 1") == "42"  # the earlier cell's output is not shown again
    environment.reset()
    assert "NameError" in environment.python("x + 1")
    plain = toolbox(session=False).factory()
    plain.python("x = 41")
    assert "NameError" in plain.python("x + 1")


def test_a_session_leaves_out_a_cell_that_timed_out_or_failed() -> None:
    """A cell that ran past its time limit is not replayed before the next call (every later call timed out too)."""
    environment = toolbox(session=True).factory()
    environment.reset()
    assert environment.python("y = 6\nprint('set')") == "set"
    assert "ran past its time limit" in environment.python("while True:\n    pass")
    assert "ZeroDivisionError" in environment.python("z = 1\n1 / 0")
    started = time.monotonic()
    assert environment.python("print(2 + 2)\ny * 7") == "4\n42"  # the clean cell's names are still there
    assert time.monotonic() - started < LIMITS["timeout_s"]
    assert [record.failed for record in environment.tool_calls] == [False, True, True, False]
