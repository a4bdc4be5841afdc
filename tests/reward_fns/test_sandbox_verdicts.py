"""Verdicts the sandbox must get right beyond containment: a program cannot forge a pass (through the harness's
globals, shared modules, or a stack frame obtained through the standard library), and a program stopped by a
resource limit, an exit or tampering never earns partial credit (GRPO would learn to aim for it)."""

import pytest

from reward_fns.code import code_tests
from reward_fns.sandbox import Sandbox, SandboxJob

# Each attack defines a wrong ``add`` (2 + 2 is not 4 for it) and tries to get "passed" anyway; ``_steal`` walks a
# frame chain for the 32-character nonce and writes a forged pass record with it.
STEAL = """
def _steal(frame):
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, str) and len(value) == 32:
                import os
                forged = (value + ' result {"status": "passed", "tests_total": 1, "tests_passed": 1, "failures": []}\\n').encode()
                for fd in range(3, 64):
                    try:
                        os.write(fd, forged)
                    except OSError:
                        pass
                os._exit(0)
        frame = frame.f_back
"""
FORGERIES = {
    "singledispatch(sys._getframe)": "import functools, sys\ndef add(a, b):\n    _steal(functools.singledispatch(sys._getframe)(1))\n    return a - b",
    "string.Formatter __globals__": "import string\ndef add(a, b):\n    g = string.Formatter().get_field('0.__globals__', (_steal,), {})[0]\n    return a - b",
    "logging.currentframe": "import logging\ndef add(a, b):\n    _steal(logging.currentframe())\n    return a - b",
    "inspect.currentframe": "import inspect\ndef add(a, b):\n    _steal(inspect.currentframe())\n    return a - b",
    "inspect.stack": "import inspect\ndef add(a, b):\n    _steal(inspect.stack()[0].frame)\n    return a - b",
    "traceback.walk_stack": "import traceback\ndef add(a, b):\n    _steal(next(traceback.walk_stack(None))[0])\n    return a - b",
    "traceback.walk_tb": "import traceback\ndef add(a, b):\n    try:\n        1/0\n    except Exception as e:\n        _steal(next(traceback.walk_tb(e.__traceback__))[0])\n    return a - b",
    "tb_frame directly": "import sys\ndef add(a, b):\n    try:\n        1/0\n    except Exception as e:\n        _steal(e.__traceback__.tb_frame)\n    return a - b",
    "signal handler frame": "import signal, os\ndef add(a, b):\n    signal.signal(signal.SIGUSR1, lambda s, f: _steal(f))\n    os.kill(os.getpid(), signal.SIGUSR1)\n    return a - b",
    "asyncio task stack": "import asyncio\ndef add(a, b):\n    async def main():\n        for f in asyncio.current_task().get_stack():\n            _steal(f)\n    asyncio.run(main())\n    return a - b",
    "sys._getframe via map": "import sys\ndef add(a, b):\n    for f in map(sys._getframe, [1]):\n        _steal(f)\n    return a - b",
    "patch __main__._write": "import __main__\n__main__._write = lambda line: None\ndef add(a, b):\n    return a - b",
    "patch json": 'import json\njson.dumps = lambda o, **k: \'{"status": "passed", "tests_total": 1, "tests_passed": 1, "failures": []}\'\ndef add(a, b):\n    return a - b',
    "patch builtins.exec then vars": "import builtins\n_saved = dict(vars(builtins))\nbuiltins.exec = lambda *a, **k: None\nbuiltins.vars = lambda *a: _saved\ndef add(a, b):\n    return a - b",
    "patch builtins.bool": "import builtins\nbuiltins.bool = lambda x: True\ndef add(a, b):\n    return a - b",
    "globals via unittest wrapper": "import unittest\ng = unittest.TestCase.assertEqual.__globals__\ng['_run_unit'] = lambda *a, **k: None\ng['_check_value'] = lambda *a, **k: None\ndef add(a, b):\n    return a - b",
    "closure cell of unittest wrapper": "import unittest\nfor c in unittest.TestCase.assertEqual.__closure__:\n    c.cell_contents = (lambda *a, **k: None)\ndef add(a, b):\n    return a - b",
    "namedtuple of always-equal": "from collections import namedtuple\nP = namedtuple('P', 'v')\nclass E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return P(E())",
    "fake dataclass eq": "from dataclasses import dataclass\n@dataclass\nclass V:\n    x: int\nV.__eq__ = lambda s, o: True\ndef add(a, b):\n    return V(a - b)",
    "compile with stdlib name": "import os\nsrc = 'def eq(a, b):\\n    return True'\nns = {}\nexec(compile(src, os.__file__, 'exec'), ns)\nclass E:\n    __eq__ = ns['eq']\ndef add(a, b):\n    return E()",
}
FORGERY_TESTS = {
    "namedtuple of always-equal": "assert add(2, 2) == P(4)",
    "fake dataclass eq": "assert add(2, 2) == V(4)",
}


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(workers=2)
    yield box
    box.close()


def test_no_forgery_passes(sandbox: Sandbox) -> None:
    names = list(FORGERIES)
    jobs = [SandboxJob(STEAL + FORGERIES[n], FORGERY_TESTS.get(n, "assert add(2, 2) == 4")) for n in names]
    results = dict(zip(names, sandbox.run_many(jobs), strict=True))
    assert not [name for name, result in results.items() if result.status == "passed"], results
    # The frame thefts were stopped at the frame, not by luck further on.
    thefts = [
        "singledispatch(sys._getframe)",
        "logging.currentframe",
        "inspect.currentframe",
        "inspect.stack",
        "traceback.walk_stack",
        "traceback.walk_tb",
        "tb_frame directly",
        "asyncio task stack",
        "sys._getframe via map",
    ]
    for name in thefts:
        assert "access to stack frames is not allowed" in results[name].failures[0], (name, results[name])


def test_signal_handlers_get_no_frame_even_after_reloading_signal(sandbox: Sandbox) -> None:
    program = (
        "import importlib, _signal, signal, os\nimportlib.reload(_signal)\ngot = []\n"
        "def frame_seen():\n    _signal.signal(signal.SIGUSR1, lambda s, f: got.append(f))\n"
        "    signal.signal(signal.SIGUSR2, lambda s, f: got.append(f))\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n    os.kill(os.getpid(), signal.SIGUSR2)\n    return got"
    )
    assert sandbox.run(SandboxJob(program, "assert frame_seen() == [None, None]")).status == "passed"


STOPPED = {
    "disk fill (file)": "def add(a, b):\n    with open('big', 'wb') as f:\n        while True:\n            f.write(b'x' * 65536)\n    return a + b",
    "disk fill (many files)": "def add(a, b):\n    i = 0\n    while True:\n        open(f'f{i}', 'wb').write(b'x' * 1000000)\n        i += 1",
    "stdout flood": "def add(a, b):\n    while True:\n        print('x' * 10000)",
    "stdout flood, caught": "def add(a, b):\n    try:\n        while True:\n            print('x' * 10000)\n    except OSError:\n        pass\n    return a + b",
    "atexit exit 0": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    raise SystemExit(0)",
    "excepthook exit 0": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\ndef add(a, b):\n    return a - b",
    "thread os._exit(0)": "import threading, os, time\ndef add(a, b):\n    threading.Thread(target=lambda: os._exit(0)).start()\n    time.sleep(1)\n    return a - b",
    "memory": "def add(a, b):\n    x = []\n    while True:\n        x.append(b'x' * 10_000_000)",
    "sys.exit(0) in test": "import sys\ndef add(a, b):\n    sys.exit(0)",
}


def test_only_a_program_that_ran_its_tests_earns_partial_credit() -> None:
    names = list(STOPPED)
    rewards = code_tests(completions=[STOPPED[n] for n in names], tests=["assert add(2, 2) == 4"] * len(names))
    assert dict(zip(names, rewards, strict=True)) == dict.fromkeys(names, 0.0)
    wrong = code_tests(completions=["def add(a, b):\n    return a - b"], tests=["assert add(2, 2) == 4"])
    assert wrong == [0.3]


def test_a_limit_reached_is_named(sandbox: Sandbox) -> None:
    flood = sandbox.run(SandboxJob(STOPPED["stdout flood, caught"], "assert add(2, 2) == 4"))
    assert flood.status == "limit" and "file-size limit" in flood.detail
    full = sandbox.run(SandboxJob(STOPPED["disk fill (many files)"], "assert add(2, 2) == 4"))
    assert full.status == "limit" and "full" in full.detail
