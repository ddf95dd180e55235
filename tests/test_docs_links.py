"""The front page and the guides stay usable: every relative link and image resolves (anchors included), every
`python -m train...` command of README.md parses its arguments without running, and neither README.md nor a guide
names a commit id (dated notes and their commits live in docs/reports/ and docs/gpu/)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
REPORTS = sorted((ROOT / "docs").glob("reports/*.md")) + sorted((ROOT / "docs").glob("gpu/*/*.md"))

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEX = re.compile(r"(?<![0-9A-Za-z_#/.-])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
HYDRA = {"train": "config", "train.bench": "bench"}  # Hydra apps, by the config they compose


def prose(text: str, spans: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced and indented code blocks, with inline code spans removed (kept: `spans`)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")):
            continue
        lines.append((number, line if spans else re.sub(r"`[^`]*`", "", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return "".join(c for c in text if c in "- " or unicodedata.category(c)[0] in "LN").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    found, count = set(), {}
    for _, line in prose(page.read_text(), spans=True):
        if match := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(match.group(1))
            found.add(base if base not in count else f"{base}-{count[base]}")
            count[base] = count.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """`page:line: target (why)` for every relative link or image of `page` that does not resolve."""
    broken = []
    for number, line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...: not checked offline
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            if not path.exists():
                broken.append(f"{page.name}:{number}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.name}:{number}: {target} (no heading #{anchor} in {path.name})")
    return broken


def commit_ids(text: str) -> list[str]:
    """The 7-40 hex-digit words of `text` that name a commit of this repository (hex colours, digests of files and
    numbers that are no commit are not)."""
    words = sorted({w for w in HEX.findall(text) if re.search(r"[a-f]", w) or len(w) >= 12})
    if not words:
        return []
    answer = subprocess.run(["git", "cat-file", "--batch-check=%(objecttype)"], input="\n".join(f"{w}^{{commit}}" for w in words),
                            capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines()
    return [w for w, kind in zip(words, answer) if kind == "commit"]


def readme_commands() -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `python -m train...` (or `accelerate launch ... -m train...`) in README's code."""
    commands = []
    for line in README.read_text().splitlines():
        if not line.startswith("    ") or "-m " not in line:
            continue
        for part in re.split(r"&&|\|\||;|\|", line.split(" # ")[0]):
            words = shlex.split(part)
            if "-m" in words and words[words.index("-m") + 1].split(".")[0] == "train":
                at = words.index("-m")
                commands.append((words[at + 1], words[at + 2:]))
    return commands


class Parsed(Exception):
    """Raised by argparse once a command's arguments parsed, so that the command stops before it runs."""


def parse_command(module: str, args: list[str], monkeypatch) -> None:
    """Parse `python -m module args` in process without running it: compose a Hydra app's overrides (and the training
    config's schema check), or stop an argparse command right after its parser accepted the arguments."""
    if module in HYDRA:
        flags = [a for a in args if a.startswith("-")]
        assert set(flags) <= {"--help"}, f"python -m {module}: unexpected flags {flags}"
        from hydra import compose, initialize_config_dir

        from routing import ConfigError
        from train.cli import CONFIGS
        from train.schema import check_config, check_overrides

        overrides = [a for a in args if not a.startswith("-")]
        if module == "train":
            check_overrides(overrides)
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name=HYDRA[module], overrides=overrides)
        if module == "train":
            try:
                check_config(cfg)
            except ConfigError as err:  # the one refusal a parsed command may meet here: a named folder that is not here
                named = [v for a in overrides for k, _, v in [a.partition("=")] if k.endswith((".pretrained", ".path", ".prompts"))]
                if not any(f"'{v}'" in str(err) and not (ROOT / v).exists() for v in named):
                    raise
        return
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):
        importlib.import_module(module).main(args)


@pytest.mark.parametrize("page", [README, *GUIDES, *REPORTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading-with-code) ![img](missing.png) [anchor](there.md#nowhere)\n"
                    "    [in code](ignored.md)\n[web](https://example.org) [self](#top)\n\n# Top\n")
    assert broken_links(page) == ["page.md:1: missing.png (no such file)",
                                  "page.md:1: there.md#nowhere (no heading #nowhere in there.md)"]


def test_readme_has_its_commands_and_no_commit_id():
    text = README.read_text()
    assert len(text.splitlines()) <= 130
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/lint-imports && .venv/bin/python -m pytest" in text
    assert commit_ids(text) == []


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_no_guide_names_a_commit_id(page):
    """Which commit measured what is history: docs/reports/ (and the docs/gpu/ report folders) keep it."""
    assert commit_ids(page.read_text()) == []


def test_a_commit_id_is_found_and_a_colour_is_not():
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()
    # Twelve digits, not seven: a seven-digit prefix can be all decimal (5331426), which commit_ids rightly reads as a number.
    assert commit_ids(f"measured at {head[:12]}, colour #1f77b4, digest {'e' * 8}") == [head[:12]]


@pytest.mark.parametrize("module, args", readme_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:40])
def test_every_readme_command_parses(module, args, monkeypatch):
    parse_command(module, args, monkeypatch)


def test_a_bad_readme_argument_is_refused(monkeypatch):
    with pytest.raises(SystemExit):
        parse_command("train.sample", ["runs/x", "--no-such-flag"], monkeypatch)
    with pytest.raises(Exception):
        parse_command("train", ["backbone=no-such-family"], monkeypatch)
