"""Every ``inflight ...`` command written in README.md and docs/ parses with the
real argument parser, and every option of every subcommand says what it does."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from inflight.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:\.venv/bin/)?inflight\s")


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each command line in the pages' code blocks, with
    backslash continuations joined."""
    found = []
    for page in PAGES:
        in_code = False
        pending = ""
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            if not in_code:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            if COMMAND.match(text):
                found.append((f"{page.name}:{number}", text))
    return found


def argv_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and words[-1] in ("&", "&&"):
        words.pop()
    return words[1:]


COMMANDS = documented_commands()


def test_the_pages_document_commands():
    assert len(COMMANDS) >= 15
    assert any("bench serve" in c for _, c in COMMANDS)


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where, command):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            build_parser().parse_args(argv_of(command))
        except SystemExit as e:  # --help exits 0
            if e.code == 0:
                return
            pytest.fail(f"{where}: `{command}` does not parse (exit {e.code}): "
                        f"{stderr.getvalue().strip()}")


def _subparsers(parser: argparse.ArgumentParser, path: str = "inflight"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


def test_bench_serve_options_all_have_a_description():
    parsers = dict(_subparsers(build_parser()))
    bench_serve = parsers["inflight bench serve"]
    undocumented = [a.option_strings[0] for a in bench_serve._actions
                    if a.option_strings and not a.help]
    assert not undocumented, f"inflight bench serve: options without --help text: {undocumented}"
