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

import _thread
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
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "function.__new__",
    }
)
# A frame is the way to the harness's state (the nonce, the tally of tests) and to the tests' namespace, so the
# program may not obtain one. The standard library obtains frames too, to read a module name or a line number:
# those functions may, and the few of them that hand the frame back to their caller only when that caller is in
# the standard library as well. Keys: (file under the standard library, function); values: the file the caller
# must be in, or None when the function keeps the frame to itself.
FRAME_USERS = {
    ("collections/__init__.py", "namedtuple"): None,
    ("enum.py", "_create_"): None,
    ("typing.py", "_caller"): None,
    ("doctest.py", "_normalize_module"): None,
    ("warnings.py", "warn"): None,
    ("traceback.py", "extract_stack"): None,
    ("traceback.py", "format_stack"): None,
    ("traceback.py", "print_stack"): None,
    ("traceback.py", "clear_frames"): None,
    ("unittest/result.py", "_is_relevant_tb_level"): None,
    ("asyncio/coroutines.py", "_format_coroutine"): None,
    ("traceback.py", "walk_tb"): "traceback.py",
    ("traceback.py", "walk_stack"): "traceback.py",
    ("traceback.py", "_walk_tb_with_full_positions"): "traceback.py",
    ("logging/__init__.py", "<lambda>"): "logging/__init__.py",  # logging.currentframe, for findCaller
}
FRAME_HOLDERS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})


class UntrustedComparison(Exception):
    """A test compared a value whose comparison methods the solution wrote (e.g. ``__eq__`` always True)."""


def _trusted_code(function: object, klass: type) -> bool:
    code = getattr(function, "__code__", None)
    if code is None:  # builtin slot, C method
        return True
    if code.co_filename == TESTS_FILE or code.co_filename.startswith(_STDLIB):
        return True
    return _generated_by_dataclasses(code, klass)


def _dataclass_reference_code() -> dict:
    """The code ``dataclasses`` generates for each comparison method and number of compared fields, made once,
    before any program runs: a solution's dataclass comparison is trusted only when its code is this code."""
    import dataclasses

    reference = {}
    for count in range(_MAX_DATACLASS_FIELDS + 1):
        fields = [f"f{index}" for index in range(count)]
        made = dataclasses.make_dataclass("R", fields, eq=True, order=True, frozen=True)
        for name in ("__eq__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__"):
            reference[(name, count)] = made.__dict__[name].__code__
    return reference


_MAX_DATACLASS_FIELDS = 24
_DATACLASS_CODE: dict = {}  # filled by prepare() before any job runs
_FIELD = object()  # dataclasses' marker of a real field, taken by prepare() before any job runs


def _compared_fields(klass: type) -> list[str] | None:
    fields = klass.__dict__.get("__dataclass_fields__")
    if type(fields) is not dict:
        return None
    compared = [name for name, spec in fields.items() if getattr(spec, "compare", False)]
    return [name for name in compared if getattr(fields[name], "_field_type", None) is _FIELD]


def _generated_by_dataclasses(code: object, klass: type) -> bool:
    """Whether ``code`` is the comparison ``dataclasses`` writes for ``klass``'s compared fields."""
    names = _compared_fields(klass)
    if names is None or code.co_filename != "<string>":
        return False
    reference = _DATACLASS_CODE.get((code.co_name, len(names)))
    if reference is None:
        return False
    renamed = {f"f{index}": name for index, name in enumerate(names)}
    expected_names = tuple(renamed.get(name, name) for name in reference.co_names)
    return (code.co_code, code.co_consts, code.co_names) == (reference.co_code, reference.co_consts, expected_names)


def _check_value(value: object, depth: int = 0) -> None:
    """Raise UntrustedComparison when ``value`` (or anything it contains) compares through solution code."""
    if depth > 20:
        raise UntrustedComparison("value nested too deeply to check")
    klass = type(value)
    for base in klass.__mro__:
        for name in COMPARISON_DUNDERS:
            method = base.__dict__.get(name)
            if method is not None and not _trusted_code(method, base):
                raise UntrustedComparison(f"{klass.__name__}.{name} is defined by the solution")
    # Containers compare their items (subclasses too, e.g. namedtuples); dataclasses compare their fields.
    if isinstance(value, dict):
        for key, item in list(dict.items(value))[:10000]:
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in list(_ITERATE[next(t for t in _ITERATE if isinstance(value, t))](value))[:10000]:
            _check_value(item, depth + 1)
    else:
        for base in klass.__mro__:
            for name in _compared_fields(base) or ():
                with contextlib.suppress(AttributeError):
                    _check_value(object.__getattribute__(value, name), depth + 1)


_ITERATE = {list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__, frozenset: frozenset.__iter__}


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


# Builtins the guards and the tally rely on, taken when the harness loads (before any program): a program that
# replaces one of them is tampering, however briefly.
_CRITICAL_BUILTINS = tuple(
    (name, getattr(builtins, name))
    for name in (
        "type",
        "isinstance",
        "bool",
        "list",
        "dict",
        "tuple",
        "set",
        "frozenset",
        "getattr",
        "next",
        "iter",
        "exec",
        "vars",
        "id",
        "object",
        "len",
        "str",
        "repr",
        "callable",
        "compile",
        "BaseException",
        "MemoryError",
        "AssertionError",
    )
)


def _builtins_intact(namespace: dict = vars(builtins), critical: tuple = _CRITICAL_BUILTINS) -> bool:
    for name, original in critical:  # noqa: SIM110 - ``all`` is a builtin the program could replace
        if namespace.get(name) is not original:
            return False
    return True


def _guarded_compare(left: object, codes: tuple[int, ...], *rights: object) -> bool:
    """``left op1 rights[0] op2 rights[1] ...`` after checking every operand is trustworthy."""
    if not _builtins_intact():
        raise UntrustedComparison("the program replaced a builtin")
    _check_value(left)
    for value in rights:
        _check_value(value)
    for code, right in zip(codes, rights, strict=False):
        if not bool(_OPERATORS[_OPERATOR_CODES[code]](left, right)):
            return False
        left = right
    return True


def _guarded_truth(value: object) -> bool:
    if not _builtins_intact():
        raise UntrustedComparison("the program replaced a builtin")
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


def _run_unit(kind: str, target: str, namespace: dict, compiled: dict, run: object = exec) -> None:
    if kind == "assert":
        run(compiled[target], namespace)
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


def _framework_state(
    namespace: dict = vars(builtins),
    test_case: dict = vars(unittest.TestCase),
    unittest_module: dict = vars(unittest),
    modules: dict = sys.modules,
    identity: object = id,
    system: object = sys,
) -> list[tuple[str, object]]:
    """Identities of everything a solution could patch to make tests pass: builtins, unittest's TestCase (its
    methods and what their closures hold), and the modules themselves. Its arguments are bound when the harness
    loads, so a program cannot make it look at copies."""
    state: list[tuple[str, object]] = [(f"builtins.{k}", identity(v)) for k, v in namespace.items()]
    for name, value in test_case.items():
        cells = getattr(value, "__closure__", None) or ()
        state.append((f"TestCase.{name}", (identity(value), *[identity(cell.cell_contents) for cell in cells])))
    state.append(("unittest.TestCase", identity(unittest_module.get("TestCase"))))
    state += [(f"sys.modules.{k}", identity(modules.get(k))) for k in ("unittest", "builtins", "sys")]
    state += [(f"sys.{k}", identity(getattr(system, k, None))) for k in ("excepthook", "unraisablehook", "displayhook")]
    return state


# Code objects are made or swapped only by the standard library's ``types.coroutine`` (asyncio uses it); a program
# that made its own could give them a standard-library file name and pass for it.
CODE_MAKERS = {("types.py", "coroutine")}
FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__")


def install_frameless_signal_handlers() -> None:
    """A signal handler the program installs is called with ``frame=None``: Python hands a handler the frame it
    interrupted, which would lead to the harness's state."""
    import _signal

    install = _signal.signal

    def frameless(signalnum: int, handler: object) -> object:
        if callable(handler):
            user_handler = handler

            def handler(signum: int, frame: object) -> object:
                return user_handler(signum, None)

        return install(signalnum, handler)

    _signal.signal = frameless


def make_audit_hook(stdlib: str, harness_file: str) -> object:
    """The audit hook installed before the program runs. Its state lives in this closure, which nothing the
    program can reach refers to (audit hooks cannot be listed)."""
    getframe, get_ident = sys._getframe, _thread.get_ident
    frame_users = {
        (f"{stdlib}/{path}", name): caller and f"{stdlib}/{caller}" for (path, name), caller in FRAME_USERS.items()
    }  # noqa: E501
    code_makers = {(f"{stdlib}/{path}", name) for path, name in CODE_MAKERS}
    answering: set = set()  # threads inside the hook: its own look at the stack raises events too

    def requester() -> object:
        return getframe(3)  # 0: this function, 1: allowed(), 2: the hook, 3: the code that raised the event

    def allowed(users: object) -> bool:
        """Whether the code that raised the event is one of ``users`` (and called as that entry requires)."""
        thread = get_ident()
        if thread in answering:  # the hook's own look at the stack
            return True
        answering.add(thread)
        try:
            frame = requester()
            code = frame.f_code
            key = (code.co_filename, code.co_name)
            if key not in users:
                return False
            needed_caller = users[key] if isinstance(users, dict) else None
            caller = frame.f_back
            return needed_caller is None or (caller is not None and caller.f_code.co_filename == needed_caller)
        finally:
            answering.discard(thread)

    def is_file_source(filename: str, source: object) -> bool:
        """Whether ``source`` is the text of ``filename`` (what importing a module compiles)."""
        try:
            with open(filename, "rb") as handle:
                on_disk = handle.read()
        except OSError:
            return False
        text = source if isinstance(source, bytes | bytearray) else source.encode() if isinstance(source, str) else None
        return text is not None and bytes(text) == on_disk

    def audit(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS or event.startswith("ctypes."):
            raise RuntimeError(f"sandbox: {event} is not allowed")
        if event == "code.__new__" and not allowed(code_makers):
            raise RuntimeError("sandbox: making code objects is not allowed")
        if event == "object.__setattr__" and len(args) > 1 and args[1] in FUNCTION_STATE:
            code = getattr(args[0], "__code__", None)
            if args[1] == "__code__" and not allowed(code_makers):
                raise RuntimeError("sandbox: replacing a function's code is not allowed")
            if code is not None and code.co_filename == harness_file:
                raise RuntimeError(f"sandbox: changing the harness's {args[1]} is not allowed")
        if event == "open" and args and isinstance(args[0], str | bytes):
            path = os.fsdecode(args[0])
            if path.startswith("/proc") or "/proc/" in path:
                raise RuntimeError("sandbox: /proc is not readable")
        if event == "compile" and len(args) > 1:
            filename = args[1] if isinstance(args[1], str) else os.fsdecode(args[1]) if args[1] else ""
            if filename == TESTS_FILE:
                raise RuntimeError("sandbox: compiling as the tests is not allowed")
            if (filename.startswith(stdlib) or filename == harness_file) and not is_file_source(filename, args[0]):
                raise RuntimeError("sandbox: code may carry a standard-library file name only with that file's source")
        frame_event = event == "sys._getframe" or (
            event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_HOLDERS
        )
        if frame_event and not allowed(frame_users):
            raise RuntimeError("sandbox: access to stack frames is not allowed")

    return audit


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


_JSON_ESCAPES = {**{code: f"\\u{code:04x}" for code in range(32)}, ord('"'): '\\"', ord("\\"): "\\\\"}


def json_text(text: str, escapes: dict = _JSON_ESCAPES) -> str:
    """``text`` as a JSON string, with str methods only (the program can patch the ``json`` module, not these).

    >>> import json; json.loads(json_text('a "b"\\\\ \\n \\ud800 é'))
    'a "b"\\\\ \\n \\ud800 é'
    """
    return '"' + text.translate(escapes).encode("utf-8", "backslashreplace").decode("utf-8") + '"'


def result_record(
    nonce: str, status: str, total: int = 0, passed: int = 0, detail: str = "", failures=(), text=json_text
) -> str:
    """The final record, formatted without the ``json`` module (which the program could patch).

    >>> import json; json.loads(result_record("n", "failed", 2, 1, "x", ["t: AssertionError"]).split(" ", 2)[2])
    {'status': 'failed', 'tests_total': 2, 'tests_passed': 1, 'detail': 'x', 'failures': ['t: AssertionError']}
    """
    items = ", ".join([text(failure) for failure in failures])
    return (
        f'{nonce} result {{"status": "{status}", "tests_total": {total}, "tests_passed": {passed}, '
        f'"detail": {text(detail)}, "failures": [{items}]}}'
    )


def run_job(job: dict, result_fd: int) -> None:
    """In the forked child: limits, unprivileged user, the program, then every test; never returns.

    Everything used once the program has started is a local taken before it started: the program can reach
    this module's globals (through the functions it is handed) and patch shared modules such as ``json``,
    but not this frame."""
    global _result_fd
    _result_fd = result_fd
    nonce = job.pop("nonce")
    write, exit_now, encode = os.write, os._exit, str.encode
    record, describe, run_unit, framework_state = result_record, _describe, _run_unit, _framework_state
    builtins_intact = _builtins_intact
    memory_error, untrusted_comparison, base_exception = MemoryError, UntrustedComparison, BaseException
    exits = (SystemExit, KeyboardInterrupt)
    # What the program printed is still in the interpreter's buffers at the end: flushed before the record (the
    # streams as they were before it ran: a replaced sys.stdout is not the run's output), so a short print shows.
    flushes = (sys.stdout.flush, sys.stderr.flush)

    def finish(line: str) -> None:
        for flush in flushes:
            try:  # noqa: SIM105 - not contextlib: the program may have patched that shared module
                flush()
            except base_exception:  # a closed or full stream: the record is written all the same
                pass
        data = encode(line + "\n")
        while data:
            data = data[write(result_fd, data) :]
        exit_now(0)  # no atexit handlers, no finalizers of the solution's objects

    try:
        _apply_limits(job["limits"], job.get("uid"))
        _drop_privileges(job.get("uid"))
    except OSError as exc:
        finish(record(nonce, "infrastructure", detail=f"setup: {exc}"))
    try:
        solution = compile(job["program"], SOLUTION_FILE, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        finish(record(nonce, "syntax_error", detail=f"{type(exc).__name__}: {getattr(exc, 'msg', exc)}{where}"))
    except MemoryError:
        finish(record(nonce, "memory", detail="compiling the program"))
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
        finish(record(nonce, "invalid_tests", detail=f"tests: {_describe(exc)}"))
    if not units:
        finish(record(nonce, "invalid_tests", detail="tests define no test"))
    _guard_unittest()
    before = framework_state()
    total = len(units)
    _write(f"{nonce} started")
    sys.modules["__main__"] = type(sys)("__main__")  # ``import __main__`` gives the program an empty module
    install_frameless_signal_handlers()
    sys.addaudithook(make_audit_hook(_STDLIB, os.path.abspath(__file__)))

    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    status, detail, passed, failures = "passed", "", 0, []
    try:
        exec(solution, namespace)
    except memory_error:
        status, detail = "memory", "MemoryError while loading the program"
    except base_exception as exc:  # SystemExit too: leaving before the tests is a failure
        status, detail = "runtime_error", describe(exc)
    entry_point = job.get("entry_point")
    if status == "passed" and entry_point and entry_point not in namespace:
        status, detail = "runtime_error", f"the program does not define {entry_point!r}"
    if status == "passed":
        test_namespace = dict(namespace)  # the solution holds no reference to the tests' namespace
        test_namespace.update(__grpoflow_compare__=_guarded_compare, __grpoflow_truth__=_guarded_truth)
        try:
            exec(setup_code, test_namespace)
        except base_exception as exc:
            status, detail = "runtime_error", f"test setup: {describe(exc)}"
    if status == "passed":
        for kind, target in units:
            try:
                run_unit(kind, target, test_namespace, compiled_asserts)
                passed += 1
            except memory_error:
                status, detail = "memory", f"MemoryError in {target}"
            except untrusted_comparison as exc:
                status, detail = "tampering", describe(exc)
            except exits as exc:  # leaving in the middle of the tests is not a test that failed
                status, detail = "runtime_error", f"the program exited during {target[:120]}: {describe(exc)}"
            except base_exception as exc:
                failures.append(f"{target[:120]}: {describe(exc)}")
            if not builtins_intact():
                status, detail = "tampering", f"the program replaced a builtin during {target[:120]}"
                break
        if status == "passed" and failures:
            status = "failed"
    if framework_state() != before:
        status, detail = "tampering", "the program changed builtins, unittest or sys hooks"
    finish(record(nonce, status, total, passed, detail, failures[:5]))


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


def _limit_hit(workdir: str, file_size_bytes: int) -> str:
    """What resource limit the job ran into, if any: a file (stdout and stderr included) that reached the
    file-size limit, or a full working directory. Checked on what the job left, so a caught error counts too."""
    seen = 0
    for root, _, files in os.walk(workdir):
        for name in files:
            seen += 1
            with contextlib.suppress(OSError):
                if os.path.getsize(os.path.join(root, name)) >= file_size_bytes:
                    return f"a file reached the {file_size_bytes >> 20} MB file-size limit"
            if seen > 10_000:
                return "more than 10,000 files written"
    with contextlib.suppress(OSError):
        stats = os.statvfs(workdir)
        if stats.f_bavail * stats.f_frsize < 1 << 16:
            return "the working directory is full"
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
        "limit_hit": _limit_hit(workdir, limits["file_size_bytes"]),
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return reply


def prepare() -> None:
    """What every job needs and no program may influence, made before any runs: the preloaded modules and the
    reference code of dataclass comparisons."""
    global _FIELD
    for name in PRELOAD:
        __import__(name)
    import dataclasses

    _FIELD = dataclasses._FIELD
    _DATACLASS_CODE.update(_dataclass_reference_code())


def serve(reply_fd: int) -> None:
    """The long-lived side of a sandbox: jobs arrive on stdin, each runs in a fresh forked child, replies go to
    ``reply_fd``. Forking from this warm interpreter is what makes a run cost milliseconds, not a new sandbox."""
    prepare()
    gc.freeze()  # forked children then do not copy the pages of every tracked object when the collector runs
    number = 0
    while (job := read_frame(0)) is not None:
        number += 1
        write_frame(reply_fd, supervise(job, number))


_STDLIB = os.path.dirname(os.__file__)

if __name__ == "__main__":
    serve(int(sys.argv[1]))
