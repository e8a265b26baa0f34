"""Renders every table of README.md and docs/*.md from the results files, and writes docs/CONFIG.md.

A page marks a rendered block like this:

    <!-- render: recovery -->
    (whatever is here is replaced)
    <!-- /render -->

NAME (``recovery`` here) is a key of ``RENDERERS`` below: its results file is
``benchmarks/results/STEM.json``, where STEM is NAME up to its first ``.`` (so one file can feed
several blocks: ``soak`` and ``soak.summary`` both read ``soak.json``), and its value names the
function that renders it, ``"benchmarks.MODULE:FUNCTION"``. ``FUNCTION(result: dict) -> str``
takes the parsed JSON and returns markdown; its module must import without starting Ray. Adding
a table to the docs is one line in ``RENDERERS`` and the two markers in a page.

Each block starts with the results file's meta line (command, commit, machine, date: see
``benchmarks/meta.py``; a field an older file lacks reads "not recorded"). A function's own
leading ``# title`` and its first paragraph, if that is its own meta line (it starts with
``Rendered from`` or quotes the results file's command), are dropped, and its
headings are moved below the page heading the block sits under.

    .venv/bin/python benchmarks/render_docs.py           # rewrite the pages that changed
    .venv/bin/python benchmarks/render_docs.py --check   # exit 1 naming each page that differs

A page whose block cannot be rendered (no results file, no renderer, a renderer's error) is
named with the error and left as it is; the exit status is then 1 as well.

``tests/unit/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"

# NAME (benchmarks/results/NAME.json; NAME.PART for a second block of the same file) -> its renderer.
RENDERERS: dict[str, str] = {
    "throughput": "benchmarks.throughput:render",
    "recovery": "benchmarks.recovery:render",
    "recovery_replica": "benchmarks.recovery:render",
    "reshard": "benchmarks.reshard:render",
    "replica_cost": "benchmarks.replica_cost:render",
    "scaling": "benchmarks.scaling:render",
    "kaggle": "benchmarks.kaggle_render:render",
    "kaggle_hosts": "benchmarks.kaggle_render:render",
    "kaggle_reference": "benchmarks.kaggle_render:render",
    "soak": "benchmarks.soak:render",
    "supervisor_state": "benchmarks.supervisor_state:render",
    "soak-hosts": "benchmarks.soak:render",
    "soak-replica": "benchmarks.soak:render",
    "cpr_tradeoff_real": "benchmarks.cpr_tradeoff_render:render_real",
    "cpr_tradeoff_emulation": "benchmarks.cpr_tradeoff_render:render_emulation",
    "trainer_failures": "benchmarks.trainer_failures:render",
    "trainer_failures_scale": "benchmarks.trainer_failures_scale:render",
    "cuda_shard_check": "benchmarks.cuda_shard_check:render",
    "suite": "benchmarks.suite:render",
    "suite_unit": "benchmarks.suite:render",
    "startup": "benchmarks.startup:render",
    "startup_plain": "benchmarks.startup:render",
    "data": "benchmarks.data_render:render",
    "replay": "benchmarks.replay:render",
}

CONFIG_PAGE = ROOT / "docs" / "CONFIG.md"
CONFIG_HEADER = (
    "# Config reference\n\n"
    "Every field of a run's YAML config (`cpr train --config FILE`, `--set KEY=VALUE` on the command line), "
    "with its type, default, allowed range and meaning. This page is generated: it is exactly the output of "
    "`cpr config-docs`, which reads the field docstrings of `core/config.py` and `core/config_failures.py`; "
    "`benchmarks/render_docs.py` writes it and `tests/unit/test_docs.py` fails when it is stale. "
    "A wrong value is refused before anything starts, naming the field and its allowed range. "
    "How to use the settings: [USER_GUIDE.md](USER_GUIDE.md); the fault settings: [CHAOS.md](CHAOS.md).\n"
)

BLOCK = re.compile(r"<!-- render: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /render -->", re.S)
HEADING = re.compile(r"^(#{1,6}) ", re.M)
NOT_RECORDED = "not recorded"


class RenderError(Exception):
    pass


def pages() -> list[Path]:
    """Every page that may hold rendered blocks: README.md and docs/**/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def renderer(name: str) -> Callable[[dict], str]:
    if name not in RENDERERS:
        raise RenderError(f"no renderer for block {name!r}: add it to RENDERERS in benchmarks/render_docs.py")
    module, _, func = RENDERERS[name].partition(":")
    return getattr(importlib.import_module(module), func)


def results_file(name: str) -> Path:
    return RESULTS / f"{name.split('.', 1)[0]}.json"


def meta_line(result: dict, json_path: Path, page: Path) -> str:
    """The results file's command, commit, machine and date; 'not recorded' for what it lacks."""
    meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
    command = _command(result)
    commit = meta.get("commit") or result.get("commit")
    date = meta.get("date") or result.get("date")
    machine = meta.get("machine") or result.get("machine")
    if isinstance(machine, dict):
        mem = machine.get("memory_gib")
        machine_s = (f"{machine.get('cpu') or 'CPU ' + NOT_RECORDED}, {machine.get('cores', '?')} cores, "
                     f"{f'{mem} GiB' if mem else 'memory ' + NOT_RECORDED}, Python {machine.get('python', '?')}")
    elif machine:
        machine_s = f"{str(machine).strip()} (CPU model and memory {NOT_RECORDED})"
    else:
        machine_s = f"machine {NOT_RECORDED}"
    link = os.path.relpath(json_path, page.parent)
    # A part measured again later (``remeasured``: part -> its own meta) says so, with its commit.
    again = "".join(f" Its {part} measured again: `{m.get('command', NOT_RECORDED)}` at commit "
                    f"`{m.get('commit', NOT_RECORDED)}`, {m.get('date', NOT_RECORDED)}."
                    for part, m in (result.get("remeasured") or {}).items() if isinstance(m, dict))
    return (f"*Rendered from [`{_rel(json_path)}`]({link}): "
            f"`{command or NOT_RECORDED}` at commit `{commit or NOT_RECORDED}` "
            f"on {machine_s}; date {date or NOT_RECORDED}.{again}*")


def _command(result: dict) -> str | None:
    meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
    command = meta.get("command") or result.get("command")
    return command.strip() if command else None


def _body(markdown: str | list[str], level_above: int, command: str | None = None) -> str:
    text = "\n".join(markdown) if isinstance(markdown, list) else markdown
    lines = text.strip("\n").splitlines()
    if lines and lines[0].startswith("# "):  # the function's own title: the page has its heading
        lines = lines[1:]
    while lines and not lines[0].strip():
        lines = lines[1:]
    end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    first = " ".join(lines[:end])
    if first.startswith("Rendered from ") or (command and command in first and len(first) < 600):
        lines = lines[end:]  # its own meta paragraph: the block starts with ours
    text = "\n".join(lines).strip("\n")
    levels = [len(m.group(1)) for m in HEADING.finditer(text)]
    if levels:
        shift = max(0, level_above + 1 - min(levels))
        text = HEADING.sub(lambda m: "#" * min(6, len(m.group(1)) + shift) + " ", text)
    return text


def _level_above(text: str, pos: int) -> int:
    """The level of the last heading before ``pos`` (1 if none), code fences skipped."""
    level, fenced = 1, False
    for line in text[:pos].splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            level = len(m.group(1))
    return level


def render_page(page: Path, text: str) -> str:
    """The page with every block rendered again."""
    out, last = [], 0
    for m in BLOCK.finditer(text):
        name = m.group("name")
        render = renderer(name)
        path = results_file(name)
        if not path.exists():
            raise RenderError(f"{_rel(page)}: block {name!r} needs {_rel(path)}, which is not there")
        result = json.loads(path.read_text())
        body = _body(render(result), _level_above(text, m.start()), _command(result))
        out += [text[last:m.start()], f"<!-- render: {name} -->\n", meta_line(result, path, page), "\n\n", body,
                "\n<!-- /render -->"]
        last = m.end()
    out.append(text[last:])
    rendered = "".join(out)
    opened, closed = rendered.count("<!-- render: "), rendered.count("<!-- /render -->")
    if opened != closed:
        raise RenderError(f"{_rel(page)}: {opened} '<!-- render: NAME -->' markers against {closed} '<!-- /render -->'")
    return rendered


def config_page() -> str:
    from core.config_docs import config_reference  # pydantic and numpy, no Ray

    # `cpr config-docs` prints config_reference() and a newline (click.echo).
    return (f"{CONFIG_HEADER}\n<!-- config-reference:start -->\n{config_reference()}\n"
            "<!-- config-reference:end -->\n")


def render_all() -> tuple[dict[Path, str], list[str]]:
    """Every page as it should be, and the errors of the pages that could not be rendered
    (those are left out: one broken results file or renderer does not stop the others)."""
    want, errors = {}, []
    try:
        want[CONFIG_PAGE] = config_page()
    except Exception as err:  # noqa: BLE001 - reported with the page's name, the others still render
        errors.append(f"{_rel(CONFIG_PAGE)}: {type(err).__name__}: {err}")
    for page in pages():
        if page == CONFIG_PAGE:
            continue
        try:
            want[page] = render_page(page, page.read_text())
        except RenderError as err:
            errors.append(str(err))
        except Exception as err:  # noqa: BLE001 - a renderer's bug, named with its page
            errors.append(f"{_rel(page)}: {type(err).__name__}: {err}")
    return want, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Change nothing; exit 1 naming each page that differs.")
    args = parser.parse_args(argv)
    want, errors = render_all()
    differ = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    for page in differ:
        rel = _rel(page)
        if args.check:
            print(f"{rel} differs from its rendering: run .venv/bin/python benchmarks/render_docs.py", file=sys.stderr)
        else:
            page.write_text(want[page])
            print(f"rendered {rel}")
    for err in errors:
        print(f"error: {err}", file=sys.stderr)
    return 1 if (errors or (args.check and differ)) else 0


if __name__ == "__main__":
    sys.exit(main())
