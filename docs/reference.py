"""The reference page, docs/reference.md: every command's flags, made from their own definitions.

The commands are pyproject.toml's [project.scripts]. `scoremap-serve`'s settings come from their declarations in
server/settings.py (`markdown_table`); every other argument of every command from its argparse parser, taken from the
command's own `main` as it parses `--help`. So a flag is described once, where the code declares it.

    python -m docs.reference           # writes docs/reference.md
    python -m docs.reference --check   # exit 1, saying what to run, when the page differs from the code

tests/test_docs.py checks the committed page the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import tomllib
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"
SERVE = "scoremap-serve"
SETTINGS_START = "<!-- settings table: made by `python -m server.settings` -->"
SETTINGS_END = "<!-- end of settings table -->"
HEADER = """# Reference: every command's flags

<!-- made by `python -m docs.reference` from the commands' definitions; tests/test_docs.py checks it -->

Every flag of every command, once, made from the code that declares it (`python -m docs.reference` writes this page;
the suite fails when the page and the code disagree). `COMMAND --help` prints the same. A numeric flag out of its range
exits 2 naming the flag, before anything loads.
"""


class _Parsed(Exception):
    """Raised instead of parsing, carrying the parser a command's `main` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def commands() -> dict[str, str]:
    """{command: "module:function"} from pyproject.toml's [project.scripts], in their order."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def parser_of(entry: str) -> argparse.ArgumentParser:
    """The argparse parser a console script's `main` builds, caught as it parses `--help` (nothing runs)."""
    module, function = entry.split(":")
    main: Callable = getattr(importlib.import_module(module), function)

    def caught(self: argparse.ArgumentParser, *args, **kwargs):
        raise _Parsed(self)

    parse_args, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, caught
    try:
        main(["--help"])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = parse_args
    raise RuntimeError(f"{entry} returned without parsing its arguments; the reference cannot read its flags")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{option}`" for option in action.option_strings)
    if action.nargs == 0:
        return names
    formatter = parser._get_formatter()
    return f"{names} `{formatter._format_args(action, action.dest.upper())}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, "", [], ()):
        return ""
    return _cell(str(action.default))


def _rows(parser: argparse.ArgumentParser, skip: set[str]) -> Iterator[str]:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.dest in skip or isinstance(
                action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        described = formatter._expand_help(action) if action.help else ""
        if isinstance(action, argparse._VersionAction):
            described = "print the version and exit"
        yield f"| {_name(parser, action)} | {_default(action)} | {_cell(described)} |"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def _summary(parser: argparse.ArgumentParser) -> str:
    first = (parser.description or "").strip().split("\n\n")[0]
    return " ".join(first.split())


def section(command: str, parser: argparse.ArgumentParser, *, level: int = 2) -> str:
    """One command's part of the page: its summary, a table of its arguments, then its subcommands'."""
    from server import settings

    settings_flags = {field.name for field in dataclasses.fields(settings.Settings)} if command == SERVE else set()
    lines = [f"{'#' * level} {command}", ""]
    if summary := _summary(parser):
        lines += [summary, ""]
    rows = list(_rows(parser, settings_flags))
    if rows:
        lines += ["| argument | default | what it does |", "| --- | --- | --- |", *rows, ""]
    if settings_flags:
        lines += [f"Its settings, declared in `server/settings.py`, group by group:", "",
                  SETTINGS_START, settings.markdown_table().rstrip("\n"), SETTINGS_END, ""]
    for name, sub in _subparsers(parser).items():
        lines.append(section(f"{command} {name}", sub, level=level + 1))
    return "\n".join(lines)


def render() -> str:
    """The whole page as the code defines it today."""
    sections = [section(command, parser_of(entry)) for command, entry in commands().items()]
    return HEADER + "\n" + "\n".join(sections).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md differs from the code")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if PAGE.read_text() != page:
            sys.stderr.write("docs/reference.md differs from the commands' definitions: run `python -m docs.reference`\n")
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
