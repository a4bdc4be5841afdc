"""The reference pages, generated from the code: every ``grpoflow`` command with its help, arguments and options
(``docs/reference/cli.md``) and every config key (``docs/reference/configuration.md``, from
``tasks.config.reference``). ``make docs`` (``python -m flows.cli.reference``) writes them; a test fails when they
are out of date or a command or option has no help.
Must not import: a stage, torch or Prefect.
"""

from __future__ import annotations

import sys
from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "docs" / "reference"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def command_docs() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """Each command as (name, help, [(parameter, default, help)]), in ``grpoflow --help``'s order."""
    import click
    import typer

    from flows.cli import app

    group = typer.main.get_command(app)
    context = click.Context(group)
    commands = []
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        params = []
        for param in command.params:
            if param.name == "help":
                continue
            shown_type = param.display_type(context)  # typer's: <path>, <int>, <bool>
            if param.param_type_name == "argument":
                shown = f"{param.name.upper()} {shown_type}"
            else:
                shown = ", ".join(param.opts) + ("" if shown_type == "<bool>" else f" {shown_type}")
            default = "" if param.default in (None, False, ()) or callable(param.default) else str(param.default)
            params.append((shown, default, param.help or ""))
        commands.append((name, command.help or "", params))
    return commands


def cli_reference() -> str:
    """The command-line reference page (Markdown)."""
    lines = [
        "# Command-line reference",
        "",
        "Generated from the commands' own help by `make docs`; do not edit by hand. Every command also takes",
        "`--debug`, `--quiet` and `--verbose` before its name (`grpoflow --debug run ...`).",
    ]
    for name, help_text, params in command_docs():
        lines += ["", f"## grpoflow {name}", "", " ".join(help_text.split())]
        if params:
            lines += ["", "| argument / option | default | help |", "|---|---|---|"]
            lines += [f"| `{_cell(p)}` | {_cell(d) and f'`{_cell(d)}`'} | {_cell(h)} |" for p, d, h in params]
    return "\n".join(lines) + "\n"


def pages() -> dict[Path, str]:
    """Each reference page's path and its text as the code makes it now."""
    from tasks.config.reference import config_reference

    return {REFERENCE_DIR / "cli.md": cli_reference(), REFERENCE_DIR / "configuration.md": config_reference()}


def main() -> None:
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
        sys.stdout.write(f"wrote {path.relative_to(REFERENCE_DIR.parents[1])}\n")


if __name__ == "__main__":
    main()
