"""The inside of the sandbox: a warm supervisor that forks one child per job, and the child that runs it.

Started by ``reward_fns.sandbox`` as ``python -I -S -B sandbox_harness.py REPLY_FD`` inside the namespaces (as the
sandbox's root, with only the capabilities to switch users); reads length-prefixed JSON jobs on stdin and answers
each on REPLY_FD. Uses the standard library only (no site-packages in the sandbox).

Order matters: limits and the unprivileged user are set, both sources are compiled and the test framework is
snapshotted *before* any untrusted code runs; then an audit hook closes the ways to the harness's state (frames,
``gc``, ``/proc``, ``ctypes``), so the program cannot read the per-run nonce or forge the final record.

The parent counts a pass only from the record ``<nonce> result {...}`` written after every test has run; an exit
(``sys.exit(0)``, ``os._exit(0)``) before that is a failure, never a pass.
Must not import: anything outside the standard library (it runs inside the sandbox).
"""

import ast
import builtins
import contextlib
import gc
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import unittest

_result_fd = 3
SOLUTION_FILE = "<solution>"
TESTS_FILE = "<tests>"
# Modules a solution or its tests commonly import, loaded while the interpreter's files are surely readable.
PRELOAD = [
    "math",
    "cmath",
    "re",
    "string",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "typing",
    "fractions",
    "decimal",
    "statistics",
    "random",
    "hashlib",
    "copy",
    "operator",
    "dataclasses",
    "enum",
    "datetime",
    "textwrap",
]
COMPARISON_DUNDERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__hash__")
BLOCKED_EVENTS = frozenset(
    {
        "sys._getframe",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "code.__new__",
        "function.__new__",
    }
)
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"})


class UntrustedComparison(Exception):
    """A test compared a value whose comparison methods the solution wrote (e.g. ``__eq__`` always True)."""


def _trusted_code(function: object) -> bool:
    code = getattr(function, "__code__", None)
    if code is None:  # builtin slot, C method
        return True
    return code.co_filename == TESTS_FILE or code.co_filename.startswith(_STDLIB)


def _check_value(value: object, depth: int = 0) -> None:
    """Raise UntrustedComparison when ``value`` (or anything it contains) compares through solution code."""
    if depth > 20:
        raise UntrustedComparison("value nested too deeply to check")
    for klass in type(value).__mro__:
        for name in COMPARISON_DUNDERS:
            method = klass.__dict__.get(name)
            if method is not None and not _trusted_code(method):
                raise UntrustedComparison(f"{type(value).__name__}.{name} is defined by the solution")
    if type(value) in (list, tuple, set, frozenset):
        for item in list(value)[:10000]:
            _check_value(item, depth + 1)
    elif type(value) is dict:
        for key, item in list(value.items())[:10000]:
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)


_OPERATORS = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_OPERATOR_CODES = list(_OPERATORS)


def _guarded_compare(left: object, codes: tuple[int, ...], *rights: object) -> bool:
    """``left op1 rights[0] op2 rights[1] ...`` after checking every operand is trustworthy."""
    _check_value(left)
    for value in rights:
        _check_value(value)
    for code, right in zip(codes, rights, strict=False):
        if not bool(_OPERATORS[_OPERATOR_CODES[code]](left, right)):
            return False
        left = right
    return True


def _guarded_truth(value: object) -> bool:
    _check_value(value)
    return bool(value)


class _GuardAsserts(ast.NodeTransformer):
    """Rewrites every ``assert`` so its comparisons go through ``_guarded_compare``/``_guarded_truth``."""

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        node.test = self._guard(node.test)
        return node

    def _guard(self, expr: ast.expr) -> ast.expr:
        if isinstance(expr, ast.BoolOp):
            return ast.BoolOp(op=expr.op, values=[self._guard(v) for v in expr.values])
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            return ast.UnaryOp(op=expr.op, operand=self._guard(expr.operand))
        if isinstance(expr, ast.Compare):
            codes = ast.Tuple(elts=[ast.Constant(_OPERATOR_CODES.index(type(op))) for op in expr.ops], ctx=ast.Load())
            return ast.Call(
                func=ast.Name("__grpoflow_compare__", ast.Load()),
                args=[expr.left, codes, *expr.comparators],
                keywords=[],
            )
        return ast.Call(func=ast.Name("__grpoflow_truth__", ast.Load()), args=[expr], keywords=[])


def _guard_unittest() -> None:
    """Check the arguments of every ``TestCase.assert*`` method the same way as plain asserts."""

    def wrap(method):  # noqa: ANN001, ANN202
        def guarded(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            for value in (*args, *kwargs.values()):
                if not callable(value):
                    _check_value(value)
            return method(self, *args, **kwargs)

        return guarded

    for name, method in list(vars(unittest.TestCase).items()):
        if name.startswith("assert") and callable(method) and "Raises" not in name and "Warns" not in name:
            setattr(unittest.TestCase, name, wrap(method))


def _test_units(tree: ast.Module, entry_point: str | None) -> tuple[ast.Module, list[tuple[str, str]]]:
    """Split a test module into setup code and test units: ``("assert", source)``, ``("call", name)``,
    ``("unittest", "Class.method")``, or ``("check", entry_point)`` for the HumanEval ``check(candidate)`` form."""
    setup: list[ast.stmt] = []
    units: list[tuple[str, str]] = []
    for statement in tree.body:
        if isinstance(statement, ast.Assert):
            units.append(("assert", ast.unparse(statement)))
            continue
        setup.append(statement)
        if isinstance(statement, ast.FunctionDef) and statement.name.startswith("test"):
            units.append(("call", statement.name))
        elif isinstance(statement, ast.ClassDef):
            for item in statement.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    units.append(("unittest", f"{statement.name}.{item.name}"))
        elif (
            entry_point
            and isinstance(statement, ast.FunctionDef)
            and statement.name == "check"
            and not any(kind == "check" for kind, _ in units)
        ):
            units.append(("check", entry_point))
    return ast.Module(body=setup, type_ignores=[]), units


def _run_unit(kind: str, target: str, namespace: dict, compiled: dict) -> None:
    if kind == "assert":
        exec(compiled[target], namespace)
    elif kind == "call":
        namespace[target]()
    elif kind == "check":
        namespace["check"](namespace[target])
    else:
        class_name, method_name = target.split(".")
        case = namespace[class_name](method_name)
        case.setUp()
        try:
            getattr(case, method_name)()
        finally:
            case.tearDown()
            case.doCleanups()


def _describe(exc: BaseException) -> str:
    try:
        message = BaseException.__str__(exc)
    except BaseException:  # noqa: BLE001 - the message is the solution's object
        message = "?"
    return f"{type(exc).__name__}: {message}"[:300]


def _framework_state() -> list[tuple[str, int]]:
    """Identities of everything a solution could patch to make tests pass: builtins and unittest."""
    state = [(f"builtins.{k}", id(v)) for k, v in vars(builtins).items()]
    state += [(f"TestCase.{k}", id(v)) for k, v in vars(unittest.TestCase).items()]
    state += [(f"sys.modules.{k}", id(sys.modules.get(k))) for k in ("unittest", "builtins", "sys")]
    return state


def _audit(event: str, args: tuple) -> None:
    if event in BLOCKED_EVENTS or event.startswith("ctypes."):
        raise RuntimeError(f"sandbox: {event} is not allowed")
    if event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRIBUTES:
        raise RuntimeError(f"sandbox: reading {args[1]} is not allowed")
    if event == "open" and args and isinstance(args[0], str | bytes):
        path = os.fsdecode(args[0])
        if path.startswith("/proc") or "/proc/" in path:
            raise RuntimeError("sandbox: /proc is not readable")
    if event == "compile" and len(args) > 1 and str(args[1]) in (TESTS_FILE,):
        raise RuntimeError("sandbox: compiling as the tests is not allowed")


def _apply_limits(limits: dict, uid: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"], limits["file_size_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    if uid is not None:  # per-user count: only meaningful for the dedicated user this run switches to
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises OSError instead of killing


def _drop_privileges(uid: int | None) -> None:
    if uid is None or os.geteuid() != 0:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise OSError("still root after setuid")


def _write(line: str) -> None:
    data = (line + "\n").encode()
    while data:
        data = data[os.write(_result_fd, data) :]


def run_job(job: dict, result_fd: int) -> None:
    """In the forked child: limits, unprivileged user, the program, then every test; never returns."""
    global _result_fd
    _result_fd = result_fd
    nonce = job.pop("nonce")
    try:
        _apply_limits(job["limits"], job.get("uid"))
        _drop_privileges(job.get("uid"))
    except OSError as exc:
        _write(f"{nonce} result " + json.dumps({"status": "infrastructure", "detail": f"setup: {exc}"}))
        os._exit(0)
    try:
        solution = compile(job["program"], SOLUTION_FILE, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        detail = f"{type(exc).__name__}: {getattr(exc, 'msg', exc)}{where}"
        _write(f"{nonce} result " + json.dumps({"status": "syntax_error", "detail": detail}))
        os._exit(0)
    except MemoryError:
        _write(f"{nonce} result " + json.dumps({"status": "memory", "detail": "compiling the program"}))
        os._exit(0)
    try:
        setup, units = _test_units(ast.parse(job["tests"], TESTS_FILE), job.get("entry_point"))
        setup = _GuardAsserts().visit(setup)
        setup_code = compile(ast.fix_missing_locations(setup), TESTS_FILE, "exec", dont_inherit=True)
        compiled_asserts = {
            source: compile(ast.fix_missing_locations(_GuardAsserts().visit(ast.parse(source))), TESTS_FILE, "exec")
            for kind, source in units
            if kind == "assert"
        }
    except SyntaxError as exc:  # the row's tests are broken: nothing can be judged
        _write(f"{nonce} result " + json.dumps({"status": "invalid_tests", "detail": f"tests: {_describe(exc)}"}))
        os._exit(0)
    if not units:
        _write(f"{nonce} result " + json.dumps({"status": "invalid_tests", "detail": "tests define no test"}))
        os._exit(0)
    _guard_unittest()
    before = _framework_state()
    _write(f"{nonce} started")
    sys.addaudithook(_audit)

    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    outcome = {"status": "passed", "tests_total": len(units), "tests_passed": 0, "failures": []}
    try:
        exec(solution, namespace)
    except MemoryError:
        outcome.update(status="memory", detail="MemoryError while loading the program")
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: leaving before the tests is a failure
        outcome.update(status="runtime_error", detail=_describe(exc))
    entry_point = job.get("entry_point")
    if outcome["status"] == "passed" and entry_point and entry_point not in namespace:
        outcome.update(status="runtime_error", detail=f"the program does not define {entry_point!r}")
    if outcome["status"] == "passed":
        test_namespace = dict(namespace)  # the solution holds no reference to the tests' namespace
        test_namespace.update(__grpoflow_compare__=_guarded_compare, __grpoflow_truth__=_guarded_truth)
        try:
            exec(setup_code, test_namespace)
        except BaseException as exc:  # noqa: BLE001
            outcome.update(status="runtime_error", detail=f"test setup: {_describe(exc)}")
    if outcome["status"] == "passed":
        for kind, target in units:
            try:
                _run_unit(kind, target, test_namespace, compiled_asserts)
                outcome["tests_passed"] += 1
            except MemoryError:
                outcome.update(status="memory", detail=f"MemoryError in {target}")
            except UntrustedComparison as exc:
                outcome.update(status="tampering", detail=str(exc))
            except BaseException as exc:  # noqa: BLE001
                outcome["failures"].append(f"{target[:120]}: {_describe(exc)}")
        if outcome["status"] == "passed" and outcome["failures"]:
            outcome["status"] = "failed"
    if _framework_state() != before:
        outcome.update(status="tampering", detail="the program changed builtins or unittest")
    outcome["failures"] = outcome["failures"][:5]
    _write(f"{nonce} result " + json.dumps(outcome))
    os._exit(0)  # no atexit handlers, no finalizers of the solution's objects


def _read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


# The framing both sides use (the parent imports these): 8 bytes of big-endian length, then that much JSON.
FRAME_HEADER = 8


def encode_frame(message: dict) -> bytes:
    """One message as a length-prefixed JSON frame.

    >>> encode_frame({"a": 1})
    b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x08{"a": 1}'
    """
    data = json.dumps(message).encode()
    return len(data).to_bytes(FRAME_HEADER, "big") + data


def complete_frame(buffer: bytes) -> dict | None:
    """The message at the start of ``buffer`` once it holds a whole frame, else None.

    >>> complete_frame(encode_frame({"a": 1})[:-1]), complete_frame(encode_frame({"a": 1}))
    (None, {'a': 1})
    """
    if len(buffer) < FRAME_HEADER:
        return None
    end = FRAME_HEADER + int.from_bytes(buffer[:FRAME_HEADER], "big")
    return json.loads(buffer[FRAME_HEADER:end]) if len(buffer) >= end else None


def read_frame(fd: int) -> dict | None:
    """One frame read from ``fd`` (blocking), or None at end of input."""
    header = _read_exact(fd, FRAME_HEADER)
    return complete_frame(header + _read_exact(fd, int.from_bytes(header, "big"))) if header else None


def write_frame(fd: int, message: dict) -> None:
    data = encode_frame(message)
    while data:
        data = data[os.write(fd, data) :]


def _user_processes(uid: int) -> list[int]:
    """Processes of ``uid`` in this PID namespace (from /proc, which the sandbox mounts for the supervisor)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except OSError:
                pass
    return found


def _kill_user(uid: int | None) -> None:
    """SIGKILL every process of the run's user (daemons that left the process group included)."""
    if uid is None or os.geteuid() != 0:
        return
    for _ in range(100):
        pids = _user_processes(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap()
        time.sleep(0.001)


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _head(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def supervise(job: dict, number: int) -> dict:
    """Run one job in a forked child with its own directory and process group; collect what it reported
    until the wall-clock deadline, then kill whatever of it is left and remove its directory."""
    limits = job["limits"]
    uid = job.get("uid") if os.geteuid() == 0 else None
    workdir = os.path.join(os.getcwd(), f"job-{number}")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
    read_end, write_end = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.closerange(3, write_end)  # the supervisor's job and reply pipes stay out of the job's reach
            os.closerange(write_end + 1, 1 << 16)
            os.setsid()
            os.chdir(workdir)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
            os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            if uid is not None:
                os.chown(out_path, uid, uid)
                os.chown(err_path, uid, uid)
            run_job(job, write_end)
        except BaseException:  # noqa: BLE001 - the supervisor's side of the child failed: say why, exit 70
            import traceback

            traceback.print_exc()
        finally:
            os._exit(70)
    os.close(write_end)
    deadline = started + limits["wall_seconds"]
    received, timed_out = b"", False
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_end], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        received = (received + chunk)[: 1 << 20]
    os.close(read_end)
    status = None
    while status is None and not timed_out:  # the pipe closed: wait for the exit, still bounded by the deadline
        waited, raw_status = os.waitpid(pid, os.WNOHANG)
        if waited:
            status = raw_status
        elif time.monotonic() >= deadline:
            timed_out = True
        else:
            time.sleep(0.001)
    if status is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    _kill_user(uid)
    _reap()
    cap = limits["output_bytes"]
    reply = {
        "result": received.decode("utf-8", "replace"),
        "returncode": os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "stdout": _head(out_path, cap),
        "stderr": _head(err_path, cap),
        "seconds": time.monotonic() - started,
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return reply


def serve(reply_fd: int) -> None:
    """The long-lived side of a sandbox: jobs arrive on stdin, each runs in a fresh forked child, replies go to
    ``reply_fd``. Forking from this warm interpreter is what makes a run cost milliseconds, not a new sandbox."""
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # forked children then do not copy the pages of every tracked object when the collector runs
    number = 0
    while (job := read_frame(0)) is not None:
        number += 1
        write_frame(reply_fd, supervise(job, number))


_STDLIB = os.path.dirname(os.__file__)

if __name__ == "__main__":
    serve(int(sys.argv[1]))
