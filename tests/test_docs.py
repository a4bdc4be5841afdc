"""The docs hold what the code holds: the generated reference is current and every key and command has a description,
no page names a config key that does not exist, and every link and anchor between pages resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.cli.reference import command_docs, pages
from tasks.config import PipelineConfig
from tasks.config.reference import config_keys

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SECTIONS = {name for name in PipelineConfig.model_fields if "." in f"{name}." and name not in ("name", "seed")}


def test_the_reference_pages_are_current() -> None:
    stale = [str(path.relative_to(REPO)) for path, text in pages().items() if path.read_text() != text]
    assert not stale, f"run `make docs`: {stale} are out of date"


def test_every_config_key_and_command_option_has_a_description() -> None:
    assert [key.path for key in config_keys(PipelineConfig) if not key.description] == []
    missing = [name for name, help_text, _ in command_docs() if not help_text.strip()]
    missing += [f"{name} {param}" for name, _, params in command_docs() for param, _, text in params if not text]
    assert missing == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading.

    >>> slug("Do the engines agree?"), slug("`grpoflow serve` and vLLM")
    ('do-the-engines-agree', 'grpoflow-serve-and-vllm')
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert broken == []


NOT_KEYS = {"model.generate"}  # transformers' method, named beside the keys


def named_keys(text: str) -> set[str]:
    """The dotted config keys a page names in backticks (``grpo.max_steps``, ``--set data.kind=code``); the MLflow
    tags and metrics a page names (``tags `grpo.stopped```) are not keys, nor file names.

    >>> sorted(named_keys("set `grpo.max_steps=5` and `rewards.0.args.url`; tags `grpo.stopped`"))
    ['grpo.max_steps', 'rewards.args.url']
    """
    found = set()
    for match in re.finditer(r"`([^`\n]+)`", text):
        before = text[max(0, match.start() - 160) : match.start()]
        if re.search(r"\b(tags?|metrics?)\b(?:(?!\.\s).)*$", before, re.S):  # in the same sentence
            continue
        for token in re.findall(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)(?==|\b)", match.group(1)):
            token = re.sub(r"\.\d+(?=\.|$)", "", token)  # a list item by its index
            if token.split(".", 1)[0] in SECTIONS and not re.search(r"\.(ya?ml|py|md|json|jsonl|db|txt)$", token):
                found.add(token)
    return found - NOT_KEYS


def test_no_page_names_a_config_key_that_does_not_exist() -> None:
    documented = config_keys(PipelineConfig)
    keys = {key.path.replace("[]", "") for key in documented}
    known = keys | {".".join(key.split(".")[:depth]) for key in keys for depth in range(1, key.count(".") + 1)}
    mappings = tuple(f"{key.path.replace('[]', '')}." for key in documented if key.type.startswith("dict"))

    def exists(token: str) -> bool:
        return token in known or token.startswith(mappings)  # a dict key's own entries (rewards.args.url)

    unknown = {}
    for page in PAGES:
        missing = sorted(token for token in named_keys(page.read_text()) if not exists(token))
        if missing:
            unknown[str(page.relative_to(REPO))] = missing
    assert unknown == {}


def test_readmes_demo_tables_were_rendered_from_the_shipped_config() -> None:
    import importlib.util

    from tasks.config import load_config

    spec = importlib.util.spec_from_file_location("render_demo_table", REPO / "bench" / "render_demo_table.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    blocks = render.block_attributes((REPO / "README.md").read_text())
    assert {block["precision"] for block in blocks} == {"bf16", "fp32"}
    for block in blocks:
        overrides = dict(item.split("=", 1) for item in block["set"].split())
        shipped = load_config(REPO / "configs" / "demo.yaml", overrides).config_hash()
        assert block["config"] == shipped, f"README's {block['precision']} table: another config"
