"""infra/lock_check.py and the lock itself: every package grpoflow declares is pinned, inside the range it declares,
and a failed resolution is reported with the requirement in conflict. (The resolution against the registry is
``make lock-check``, which CI runs after the tests.)"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "infra"))
import lock_check  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINS = lock_check.pinned((ROOT / "constraints.txt").read_text())
FAST_MOVING = ("trl", "transformers", "peft", "accelerate")


def declared() -> list[Requirement]:
    return [Requirement(line) for line in lock_check.requirements(PYPROJECT)]


def test_every_declared_package_is_pinned_inside_its_declared_range() -> None:
    outside = []
    for requirement in declared():
        name = lock_check.canonical(requirement.name)
        version = PINS.get(name)
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{requirement} (lock: {version})")
    assert not outside
    assert PINS["vllm"] and PINS["torch"]  # the GPU extra's engine and the one torch for every target


def test_fast_moving_packages_have_upper_bounds() -> None:
    bounded = {lock_check.canonical(r.name) for r in declared() if any(s.operator == "<" for s in r.specifier)}
    assert set(FAST_MOVING) <= bounded
    gpu = [Requirement(line) for line in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert [r.name for r in gpu] == ["trl"] and "vllm" in gpu[0].extras


def test_a_conflict_is_reported_with_the_requirements_that_clash() -> None:
    stdout = (
        "Collecting vllm==0.31.0\n"
        "The conflict is caused by:\n"
        "    vllm 0.31.0 depends on transformers<5.18.0 and >=5.10.4\n"
        "    The user requested (constraint) transformers==5.24.0\n"
        "\n"
        "To fix this you could try to:\n"
    )
    stderr = "WARNING: Location 'file:///x' is ignored\nERROR: ResolutionImpossible: for help visit ...\n"
    assert lock_check.failure_reasons(stdout, stderr) == [
        "ERROR: ResolutionImpossible: for help visit ...",
        "The conflict is caused by:",
        "    vllm 0.31.0 depends on transformers<5.18.0 and >=5.10.4",
        "    The user requested (constraint) transformers==5.24.0",
    ]
    # Another failure (no wheel for a platform, a network error): pip's own last lines, without its noise.
    assert lock_check.failure_reasons("", "WARNING: Location 'x'\nNo matching distribution for vllm\n") == [
        "No matching distribution for vllm"
    ]


def test_a_resolved_package_the_lock_does_not_pin_is_named() -> None:
    resolved = {"torch": "2.13.0+cpu", "vllm": "0.31.0", "six": "1.17.0"}
    assert lock_check.unpinned(resolved, {"torch": "2.13.0", "vllm": "0.31.0"}) == ["six 1.17.0"]
    assert lock_check.unpinned(resolved, {"torch": "2.13.0", "vllm": "0.30.0", "six": "1.17.0"}) == ["vllm 0.31.0"]
