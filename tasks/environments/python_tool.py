"""The built-in ``python`` tool: the model's code runs in the code reward's sandbox (``reward_fns.sandbox``: no
network, no host files, an unprivileged user, CPU, memory, process, wall-clock and output limits) and what it
printed comes back as the tool's answer, like a notebook cell: the value of a last bare expression is printed too.

Everything about the model's code happens inside the sandbox, its parsing included: this process only writes a
fixed wrapper around the code as a string literal. With a session, a call runs after the rollout's earlier calls
that ran cleanly (replayed with their output hidden), so names they defined are there; a cell that failed, timed
out or ran out of memory is left out, so it cannot take the calls after it down with it.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reward_fns.sandbox import SandboxJob, SandboxLimits, SandboxResult

# The harness runs a program, then its tests: one that always holds makes "passed" mean "the program ran to its end".
RAN_TO_ITS_END = "assert True"

# Runs one cell inside the sandbox: parses it there, executes it in the module's namespace, prints the value of a
# last bare expression (as a notebook does). Earlier cells of a session run first with their output discarded.
_RUNNER = """import ast as _grpoflow_ast, io as _grpoflow_io, sys as _grpoflow_sys
def _grpoflow_cell(source, show):
    try:
        tree = _grpoflow_ast.parse(source, "<cell>")
    except SyntaxError as error:
        raise SyntaxError(f"{error.msg} (line {error.lineno})") from None
    last = None
    if show and tree.body and isinstance(tree.body[-1], _grpoflow_ast.Expr):
        last = _grpoflow_ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), globals())
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), globals())
        if value is not None:
            print(repr(value))
"""
_REPLAY = """_grpoflow_shown, _grpoflow_sys.stdout = _grpoflow_sys.stdout, _grpoflow_io.StringIO()
{cells}
_grpoflow_sys.stdout = _grpoflow_shown
"""
_REPLAYED_CELL = """try:
    _grpoflow_cell({cell!r}, False)
except BaseException:
    pass"""


@dataclass(frozen=True)
class PythonLimits:
    """What one call of the tool may use (``tools.use[].args`` of the python tool)."""

    timeout_s: float = 5.0
    cpu_seconds: int = 3
    memory_mb: int = 256
    output_bytes: int = 1024

    def sandbox_limits(self) -> SandboxLimits:
        return SandboxLimits(
            cpu_seconds=self.cpu_seconds,
            wall_seconds=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
        )


@dataclass(frozen=True)
class PythonAnswer:
    """What one call gave: the text the model reads, whether the program failed, and the sandbox's status."""

    text: str
    failed: bool
    status: str
    seconds: float = 0.0


def cell_program(code: str, earlier: Sequence[str] = ()) -> str:
    """The program the sandbox runs for one call: the runner, the session's ``earlier`` cells (output hidden), then
    ``code`` with its last bare expression shown. The model's text appears only as string literals.

    >>> "'print(1)'" in cell_program("print(1)"), "_grpoflow_cell('x = 2', False)" in cell_program("x", ["x = 2"])
    (True, True)
    """
    program = _RUNNER
    if earlier:
        program += _REPLAY.format(cells="\n".join(_REPLAYED_CELL.format(cell=cell) for cell in earlier))
    return program + f"_grpoflow_cell({code!r}, True)\n"


def answer_text(result: SandboxResult, limits: PythonLimits) -> PythonAnswer:
    """The tool's answer from a sandbox result: the output (said when cut at ``output_bytes``), then what went wrong.

    >>> answer_text(SandboxResult("passed", stdout="56088\\n"), PythonLimits()).text
    '56088'
    >>> failure = SandboxResult("runtime_error", detail="ZeroDivisionError: division by zero")
    >>> answer = answer_text(failure, PythonLimits())
    >>> answer.text, answer.failed
    ('Error: ZeroDivisionError: division by zero', True)
    """
    output = (result.stdout + result.stderr).rstrip("\n")
    if len((result.stdout + result.stderr).encode()) >= limits.output_bytes:
        output += f"\n[output cut at {limits.output_bytes} bytes]"
    problem = {
        "passed": "",
        "syntax_error": f"Error: {result.detail}",
        "runtime_error": f"Error: {result.detail}",
        "timeout": f"Error: the program ran past its time limit ({limits.timeout_s:g} s) and was stopped",
        "memory": f"Error: the program ran out of memory ({limits.memory_mb} MB)",
        "limit": f"Error: {result.detail}",
        "killed": f"Error: the program was stopped ({result.detail})",
    }.get(result.status, f"Error: {result.status}: {result.detail}")
    text = "\n".join(part for part in (output, problem) if part) or "[no output: print what you need]"
    return PythonAnswer(text, failed=bool(problem), status=result.status, seconds=result.seconds)


class SandboxUnavailable(RuntimeError):
    """The sandbox itself failed (twice): the call is a tool failure, not the program's."""


def run_python(code: str, limits: PythonLimits, earlier: Sequence[str] = ()) -> PythonAnswer:
    """Run one call of the tool in the shared sandbox of its limits. SandboxUnavailable when the sandbox failed.

    >>> run_python("x = 6 * 7\\nx", PythonLimits()).text
    '42'
    """
    from reward_fns.code import shared_sandbox

    sandbox = shared_sandbox(limits.sandbox_limits())
    result = sandbox.run(SandboxJob(program=cell_program(code, earlier), tests=RAN_TO_ITS_END))
    if result.status == "infrastructure":
        raise SandboxUnavailable(f"the sandbox failed: {result.detail[:200]}")
    return answer_text(result, limits)
