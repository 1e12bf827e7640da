"""The code blocks of the README and of every page of docs/, run as written from the repository root.

Fenced blocks are run verbatim: ```python with this interpreter, ```sh with bash. ```text marks output
shown, not run; any other fence fails here until it says which it is. A block that cannot run in a test
(one that serves until stopped) is preceded by `<!-- readme: not run (why) -->`, and says why: use it
sparingly, for blocks another test runs. A block that needs a server says so in the text before it, as a
reader needs to know too: "With `scoremap-serve ...` running"; the test starts that very command (one server
at a time, on the port it names) and waits for its health to say SERVING. A block that talks to 127.0.0.1
without such a sentence fails. models/default.onnx is converted first when `make demo` has not made it.

Shell blocks find the project's commands as an activated environment would (this interpreter's bin/ first
on PATH). Indented blocks are command synopses (placeholders such as `[more.onnx ...]`, ADDR, photos/ of your
own) and a formula: they are not run, but each of this project's commands they show (scoremap-*, python -m,
make) must exist and take every flag shown. Every model a page serves is one a page converts, under models/.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# docs/reference.md is made from the commands' help texts (tests/test_docs.py): synopses, no examples.
PAGES = [README, *(page for page in sorted((ROOT / "docs").glob("*.md")) if page.name != "reference.md")]
MODEL = ROOT / "models" / "default.onnx"
SHELL = ["bash", "-euo", "pipefail", "-s"]
RUN = {"python": [sys.executable, "-"], "sh": SHELL, "bash": SHELL, "shell": SHELL}
SHOWN = ("text",)
NOT_RUN = re.compile(r"<!-- readme: not run \((.+)\) -->")
SERVER_ADDRESS = re.compile(r"127\.0\.0\.1:\d+")
NEEDS_SERVER = re.compile(r"[Ww]ith `(scoremap-serve [^`]+)` running")
# The console scripts of pyproject.toml, as modules run from this checkout.
COMMANDS = {
    "scoremap-convert": ["convert.convert_cli"], "scoremap-inspect": ["convert.inspect_cli"],
    "scoremap-serve": ["server.main"], "scoremap-score": ["clients.batch.score_cli"],
    "scoremap-loadtest": ["clients.loadtest.run"], "scoremap-export": ["convert.triton_export"],
}
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    text: str
    not_run: str = ""
    server: str = ""  # the scoremap-serve command the text before the block says must be running

    def __str__(self) -> str:
        return f"{self.page}:line{self.line}-{self.language or 'untagged'}"


def fenced_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks, lines, n, prose_start = [], text.splitlines(), 0, 0
    while n < len(lines):
        if lines[n].startswith("```"):
            start, language = n, lines[n][3:].strip()
            n += 1
            while not lines[n].startswith("```"):
                n += 1
            reason = NOT_RUN.search(lines[start - 1]) if start else None
            server = NEEDS_SERVER.findall(" ".join(lines[prose_start:start]))
            blocks.append(Block(page, start + 1, language, "\n".join(lines[start + 1:n]) + "\n",
                                reason.group(1) if reason else "", server[-1] if server else ""))
            prose_start = n + 1
        n += 1
    return blocks


def indented_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of each command in the indented blocks, continuation lines joined, comments dropped."""
    commands, lines, fenced, previous_blank, pending = [], text.splitlines(), False, True, ""
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        in_block = not fenced and line.startswith("    ") and (previous_blank or pending or commands and commands[-1][0] == n - 1)
        if in_block and line.strip():
            command = pending + re.split(r"\s#", line.strip())[0].rstrip()
            if command.endswith("\\"):
                pending = command[:-1] + " "
                continue
            pending = ""
            commands.append((n, shlex.split(command)))
        previous_blank = not line.strip()
    return commands


def help_command(words: list[str]) -> tuple[str, ...]:
    """The `--help` call answering for a command line: its module, and its subcommand if it has one."""
    module, rest = (COMMANDS[words[0]], words[1:]) if words[0] in COMMANDS else ([words[2]], words[3:])
    return (*module, *[w for w in rest[:1] if re.fullmatch(r"[a-z]+", w)])


def help_text(command: tuple[str, ...]) -> str:
    done = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"python -m {' '.join(command)} --help failed:\n{done.stderr}"
    return done.stdout


def _env() -> dict[str, str]:
    """This checkout first on the import path, and this interpreter's console scripts first on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": path}


@pytest.fixture(scope="module")
def model() -> Path:
    """models/default.onnx, as `make demo` leaves it (converted here when missing)."""
    if not MODEL.exists():
        MODEL.parent.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "convert.convert_cli", "default", "-o", str(MODEL)], cwd=ROOT,
                       env=_env(), check=True, capture_output=True, timeout=600)
    return MODEL


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """serve(command) runs a `scoremap-serve ...` command line from a page until a block needs another
    (they may share a port) or the module ends, and waits until its health says SERVING."""
    from clients.batch.demo import stop_server, wait_until_serving

    current: dict[str, subprocess.Popen] = {}
    log = tmp_path_factory.mktemp("readme_server") / "scoremap-serve.log"

    def serve(command: str) -> None:
        if command in current:
            return
        for process in current.values():
            stop_server(process)
        current.clear()
        words = shlex.split(command)
        assert "--port" in words, f"`{command}`: name its --port, so readers know where the example connects"
        port = words[words.index("--port") + 1]
        with log.open("w") as output:
            process = subprocess.Popen([sys.executable, "-m", *COMMANDS[words[0]], *words[1:]], cwd=ROOT, env=_env(),
                                       stdout=output, stderr=subprocess.STDOUT)
        current[command] = process
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            try:
                wait_until_serving(f"127.0.0.1:{port}", timeout_s=2.0)
                return
            except Exception:  # not listening yet; the server's own exit is checked above
                time.sleep(0.5)
        stop_server(process)
        raise AssertionError(f"`{command}` did not come up (port {port} in use?):\n{log.read_text()[-3000:]}")

    yield serve
    for process in current.values():
        stop_server(process)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


BLOCKS = [block for page in PAGES for block in fenced_blocks(page.read_text(), _name(page))]


def test_the_readme_has_runnable_blocks():
    assert sum(block.language in RUN and not block.not_run and block.page == "README.md" for block in BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_a_fenced_block_runs_as_written(block: Block, request):
    if block.language in SHOWN:
        return
    assert block.language in RUN, (
        f"{block.page} line {block.line}: a fence tagged {block.language!r}; tag it python or sh/bash (run by this "
        f"test), text (output shown), or precede it with `<!-- readme: not run (why) -->`")
    if block.not_run:
        pytest.skip(f"{block.page} marks it not run: {block.not_run}")
    if block.server:
        request.getfixturevalue("server")(block.server)
    else:
        assert not SERVER_ADDRESS.search(block.text), (
            f"{block.page} line {block.line} talks to a server: say which before it, \"With `scoremap-serve ...` running\"")
    if "models/default.onnx" in block.text:
        request.getfixturevalue("model")
    done = subprocess.run(RUN[block.language], input=block.text, cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, f"{block.page} line {block.line} failed:\n{block.text}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{block.page} line {block.line} shows nothing when run; an example prints what it gets"


def test_every_command_shown_exists_and_takes_its_flags():
    makefile = (ROOT / "Makefile").read_text()
    problems, commands = [], []
    for page, line, words in _page_commands(indented_commands):
        if words[0] == "make":
            problems += [f"{page} line {line}: no make target {t!r}" for t in words[1:] if f"\n{t}:" not in makefile]
        elif words[0] in COMMANDS or words[:2] == ["python", "-m"]:  # not Docker's, nor the memory model's formula
            commands.append((page, line, words))
    keys = sorted({help_command(words) for _, _, words in commands})
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # each --help is a Python start-up: side by side
        helps = dict(zip(keys, pool.map(help_text, keys)))
    for page, line, words in commands:
        key = help_command(words)
        for word in words:
            flag = word.strip("[]").split("=")[0]
            if flag.startswith("--") and flag not in helps[key]:
                problems.append(f"{page} line {line}: {' '.join(words[:2])} has no flag {flag}")
    assert not problems, "\n".join(problems)


def _inline_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of each `scoremap-...` command quoted inline in the prose."""
    return [(n, shlex.split(quoted)) for n, line in enumerate(text.splitlines(), 1)
            for quoted in re.findall(r"`(scoremap-[^`]+)`", line)]


def _page_commands(*finders) -> list[tuple[str, int, list[str]]]:
    """(page, line, words) of the commands each finder finds, on every page."""
    return [(_name(page), line, words) for page in PAGES for find in finders for line, words in find(page.read_text())]


def test_models_are_written_under_models_and_served_from_where_they_were_written():
    """`scoremap-convert default -o os16.onnx` once wrote to the repository root, and the serving example then asked
    for models/os16.onnx, which did not exist. Every model a page converts is written under models/ (ignored by
    git), and every model a page serves is one some page converts."""
    commands = _page_commands(indented_commands, _inline_commands)
    conversions = [(page, line, words[words.index("-o") + 1]) for page, line, words in commands
                   if words[0] == "scoremap-convert" and "-o" in words]
    written = {path for _, _, path in conversions}
    assert "models/default.onnx" in written
    problems = [f"{page} line {line}: `scoremap-convert ... -o {path}` writes outside models/"
                for page, line, path in conversions if not path.startswith("models/")]
    assert "/models/" in (ROOT / ".gitignore").read_text().splitlines()
    for page, line, words in commands:
        if words[0] == "scoremap-serve":
            served = [word.split("=", 1)[-1] for word in words[1:] if word.endswith(".onnx") and not word.startswith("[")]
            problems += [f"{page} line {line}: scoremap-serve {path}, which no example converts" for path in served
                         if path not in written]
    assert not problems, "\n".join(problems)


def test_the_sizing_output_shown_is_what_the_command_prints(model, capsys):
    """The sizing block once showed CPU MiB of an older memory model (52 / 130 / 1,689 where the command printed
    47 / 129 / 1,762). The ```text block after `python -m bench.sizing ...` is its output now."""
    from bench.sizing import main

    (page, line, words), = [(page, line, words) for page, line, words in _page_commands(indented_commands)
                            if words[:3] == ["python", "-m", "bench.sizing"]]
    shown = next(block for block in BLOCKS if block.page == page and block.line > line)
    assert shown.language == "text", f"{page} line {line}: the sizing command's output follows it in a ```text block"
    assert main(words[3:]) == 0
    printed = capsys.readouterr().out
    assert shown.text == printed, f"{page} line {shown.line}: paste the output of `{' '.join(words)}` again"
