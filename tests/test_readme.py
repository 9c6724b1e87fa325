"""The README and docs as a user reads them: short, undated prose, a quick start that runs, and commands whose
arguments the programs accept."""

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def commands(path: Path) -> list[str]:
    """Every `python jobs/...`, `python -m jobs.` / `bench.` command of a file's bash blocks and inline code
    (continuations joined, `ray job submit ... --` and environment assignments stripped)."""
    found = []
    text = path.read_text()
    inline = [m.replace("\n", " ") for m in re.findall(r"(?<!`)`([^`]*python[^`]*)`(?!`)", text)]
    for block in code_blocks(path, "bash") + inline:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if " -- python " in line:
                line = "python " + line.split(" -- python ", 1)[1]
            words = shlex.split(line) if line else []
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)
            if any("<" in w or re.fullmatch(r"[A-Z]+", w) for w in words):
                continue  # a template with placeholders (`--draft DRAFT`, `jobs/<name>.py`), not a command
            if len(words) > 1 and words[0] == "python" and (words[1].startswith(("jobs/", "bench/"))
                                                            or words[1:2] == ["-m"] and words[2].startswith(("jobs.", "bench."))):
                found.append(" ".join(shlex.quote(w) for w in words))
    return found


def test_the_readme_is_short_and_carries_no_history():
    lines = README.read_text().splitlines()
    assert len(lines) <= 160
    dated = [line for line in lines if re.search(r"20\d\d-\d\d-\d\d", line)]
    assert all("bench/results/" in line for line in dated), dated  # only the status table's links carry dates


@pytest.mark.parametrize("path", [README, *DOCS, *sorted((ROOT / "eagle_core").rglob("*.py")),
                                  *sorted((ROOT / "pipelines").rglob("*.py"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_diary_words(path):
    text = path.read_text()
    assert not re.search(r"evening|afternoon|I stopped", text), path


def _accepts(command: str, monkeypatch) -> None:
    """Run the command's program up to its argument parsing, which must accept the arguments (argparse exits
    with status 2 on a bad one); nothing after parsing runs."""
    words = shlex.split(command)[1:]
    parse = argparse.ArgumentParser.parse_args

    class Parsed(Exception):
        pass

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    if words[0] == "-m":
        monkeypatch.setattr(sys, "argv", [words[1], *words[2:]])
        run = lambda: runpy.run_module(words[1], run_name="__main__")  # noqa: E731
    else:
        monkeypatch.setattr(sys, "argv", words)
        monkeypatch.syspath_prepend(str(ROOT))
        run = lambda: runpy.run_path(str(ROOT / words[0]), run_name="__main__")  # noqa: E731
    with pytest.raises(Parsed):
        run()


DOC_COMMANDS = [(path.relative_to(ROOT), c) for path in [README, *DOCS] for c in commands(path)]


@pytest.mark.parametrize("where,command", DOC_COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in DOC_COMMANDS])
def test_every_documented_command_parses(where, command, monkeypatch):
    """Commands that need a cluster, GPUs or the hub are not run here; their arguments are checked."""
    _accepts(command, monkeypatch)


@pytest.mark.slow
def test_the_quick_start_runs(capsys):
    (block,) = code_blocks(README, "python")
    exec(compile(block, "README.md quick start", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"tau \d\.\d\d tokens per target forward", out), out
    assert len(out.splitlines()[0]) > 0


@pytest.mark.parametrize("path", [README, *DOCS, ROOT / "bench/results/README.md"], ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target and not (path.parent / target).exists():
            missing.append(target)
    assert not missing, missing
