"""Tool canaries: known calls each configured tool must answer as expected, checked in validate (and by ``grpoflow
check``) before any training: the python tool's built-in cases (a print, a last expression, a program's error, no
network) and the cases a ``tools.use`` entry lists for its own tool.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tasks.config import PYTHON_TOOL, ToolCanary
from tasks.environments.toolbox import Toolbox, error_answer

PYTHON_CANARIES = (
    ToolCanary(arguments={"code": "print(6 * 7)"}, expect="42"),
    ToolCanary(arguments={"code": "values = [3, 4, 5]\nsum(values)"}, expect="12"),
    ToolCanary(arguments={"code": "1 / 0"}, expect="ZeroDivisionError"),
    # No network: the sandbox's own namespace has only loopback (checked without sending anything anywhere).
    ToolCanary(arguments={"code": "import socket\nsorted(name for _, name in socket.if_nameindex())"}, expect="['lo']"),
)


@dataclass
class ToolCanaryResult:
    tool: str
    arguments: dict[str, Any]
    expect: str
    answer: str

    @property
    def passed(self) -> bool:
        return self.expect in self.answer

    def describe(self) -> str:
        return f"tool {self.tool}{self.arguments}: expected {self.expect!r} in its answer, got {self.answer[:200]!r}"


def check_tool_canaries(toolbox: Toolbox) -> list[ToolCanaryResult]:
    """Every canary's call on a fresh rollout's environment (limits as configured), with the answer it gave (for a
    call that raised, what the model would read: ``error_answer``)."""
    results = []
    for spec in toolbox.settings.use:
        cases = list(spec.canaries) + (list(PYTHON_CANARIES) if spec.name == PYTHON_TOOL else [])
        for case in cases:
            environment = toolbox.factory()
            environment.reset()
            try:
                answer = str(getattr(environment, spec.label)(**case.arguments))
            except Exception as error:  # noqa: BLE001 - the answer the model would read
                answer = error_answer(error)
            results.append(ToolCanaryResult(spec.label, case.arguments, case.expect, answer))
    return results


def canary_report(results: list[ToolCanaryResult], toolbox: Toolbox) -> dict[str, Any]:
    """What validate writes (``tool_canaries.json``): every case, and the tools no canary checks."""
    checked = {result.tool for result in results}
    return {
        "cases": [asdict(result) | {"passed": result.passed} for result in results],
        "unchecked": [spec.label for spec in toolbox.settings.use if spec.label not in checked],
    }
