"""Render a demo run's ``summary.json`` as the table README carries, so README's figures are the run's own: the
hold-out table per model, GRPO's gain over SFT with its paired interval, the wall time, and the conditions (commit,
CPU, its instructions, precision, cores, whether caches were warm, the date). The block opens with the config hash it
was measured on (``tests/test_docs.py`` fails when that is not the shipped ``configs/demo.yaml``'s).

    make demo                                    # or: grpoflow run configs/demo.yaml --set model.precision=fp32
    .venv/bin/python bench/render_demo_table.py outputs/demo/<run>/summary.json --write README.md \\
        --caches 'venv and model cached, evaluation cold'
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BLOCK = re.compile(r"<!-- demo-table (?P<attrs>[^>]*?) -->\n.*?<!-- end demo-table -->\n", re.S)


def block_attributes(text: str) -> list[dict[str, str]]:
    """The attributes of each rendered block in ``text`` (precision, config, set).

    >>> block_attributes('<!-- demo-table precision=bf16 config=abc set="" -->\\nx\\n<!-- end demo-table -->\\n')
    [{'precision': 'bf16', 'config': 'abc', 'set': ''}]
    """
    found = []
    for match in BLOCK.finditer(text):
        attributes = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', match.group("attrs")))
        found.append({key: value.strip('"') for key, value in attributes.items()})
    return found


def minutes(seconds: float) -> str:
    """
    >>> minutes(313.4)
    '5 min 13 s'
    """
    return f"{int(seconds // 60)} min {round(seconds % 60):d} s"


def render(summary: dict, overrides: list[str], caches: str) -> str:
    """The Markdown block for one run."""
    run = summary["run"]
    machine = run["machine"]
    models = summary["evaluation"]["models"]
    ks = list(next(iter(models.values()))["pass_at_k"])
    lines = [
        f'<!-- demo-table precision={machine["precision"]} config={run["config_hash"]} set="{" ".join(overrides)}" '
        "(bench/render_demo_table.py; do not edit) -->",
        f"| model ({machine['precision']}) | greedy accuracy | "
        + " | ".join(f"pass@{k}" for k in ks)
        + " | pass@1 95% CI |",
        "|---|---|" + "---|" * len(ks) + "---|",
    ]
    for name, score in models.items():
        low, high = score["pass1_interval"]
        cells = " | ".join(f"{100 * score['pass_at_k'][k]:.1f} %" for k in ks)
        lines.append(
            f"| {name} | {100 * score['greedy_accuracy']:.1f} % | {cells} | [{100 * low:.1f}, {100 * high:.1f}] |"
        )
    gain = summary["evaluation"]["comparisons"].get("grpo-vs-sft")
    said = []
    if gain:
        said.append(
            f"GRPO over SFT: {100 * gain['mean']:+.1f} points of pass@1, paired 95 % CI "
            f"[{100 * gain['low']:+.1f}, {100 * gain['high']:+.1f}] over {gain['n']} hold-out prompts"
        )
    selected = (summary.get("grpo") or {}).get("selected")
    if selected:
        said.append(f"adapter of GRPO step {selected['step']} of {selected['last_step']} ({selected['select']})")
    promotion = summary.get("promotion") or {}
    if promotion:
        said.append(f"v{promotion['version']} {'promoted' if promotion['promoted'] else 'not promoted'}")
    command = "`make demo`" if not overrides else f"`grpoflow run configs/demo.yaml --set {' --set '.join(overrides)}`"
    cpu = machine["cpu"] or "unknown CPU"
    isa = machine["device"].split(";")[0].removeprefix("cpu:")
    lines += [
        "",
        "; ".join(said) + ".",
        f"{command}: {minutes(run['wall_seconds'])} "
        f"({caches}), commit {run['commit'][:7]}, {cpu} ({isa}), {machine['cores']} cores, "
        f"{machine['precision']}, {run['started_at'][:10]}.",
        "<!-- end demo-table -->",
    ]
    return "\n".join(lines) + "\n"


def write(readme: Path, block: str) -> None:
    """Replace the block of the same precision in ``readme`` (there must be one)."""
    precision = block_attributes(block)[0]["precision"]
    text = readme.read_text()
    for match in BLOCK.finditer(text):
        if block_attributes(match.group(0))[0]["precision"] == precision:
            readme.write_text(text[: match.start()] + block + text[match.end() :])
            return
    raise SystemExit(f"{readme} has no demo-table block for {precision}: add one where the table goes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="The --set the run was given.")
    parser.add_argument(
        "--caches", required=True, help="What was cached before the run, e.g. 'venv and model warm, evaluation cold'."
    )
    parser.add_argument("--write", type=Path, help="Replace the block of the same precision in this file.")
    args = parser.parse_args()
    block = render(json.loads(args.summary.read_text()), args.overrides, args.caches)
    if args.write:
        write(args.write, block)
    else:
        sys.stdout.write(block)


if __name__ == "__main__":
    main()
