"""docs/benchmarks.md and the benchmarks that write it: every bench's section is in the doc exactly once, under its
own heading, with a command of this repo that rewrites that very section; a rerun replaces its section and
nothing else."""

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from app.bench import report
from app.cli import BENCHES

ROOT = Path(__file__).resolve().parents[2]
WRITERS = [*sorted((ROOT / "app" / "bench").glob("*.py")), ROOT / "app" / "sim.py"]
MARKER = re.compile(r"<!-- bench:(.+?):(start|end) -->")


def doc() -> str:
    return report.DOC.read_text()


def marked_sections(text: str) -> dict[str, str]:
    """Section name -> its text between the markers (markers included)."""
    return {m.group(1): m.group(0) for m in re.finditer(r"<!-- bench:(.+?):start -->.*?<!-- bench:\1:end -->",
                                                        text, re.DOTALL)}


def section_names_in_code() -> dict[str, list[str]]:
    """Module file -> the section names (``SECTION*`` constants; ``{...}`` marks a template) it writes."""
    found = {}
    for path in WRITERS:
        names = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.startswith("SECTION")
                                                    for t in node.targets):
                value = ast.literal_eval(node.value)
                names += list(value.values()) if isinstance(value, dict) else [value]
        if names:
            found[path.name] = names
    return found


def test_every_marked_section_is_there_once_under_its_own_heading_and_a_capability():
    text = doc()
    names = [m.group(1) for m in MARKER.finditer(text) if m.group(2) == "start"]
    assert names, "no marked sections in docs/benchmarks.md"
    first_capability = text.index("\n## ")
    for name in names:
        assert text.count(f"<!-- bench:{name}:start -->") == 1, name
        assert text.count(f"<!-- bench:{name}:end -->") == 1, name
        assert text.count(f"\n{report.HEADING} {name}\n") == 1, name
        assert f"<!-- bench:{name}:start -->\n{report.HEADING} {name}\n" in text, name
        assert text.index(f"<!-- bench:{name}:start -->") > first_capability, f"{name} sits under no ## heading"
    assert len(marked_sections(text)) == len(names)  # every start has its end, none nested


def test_every_section_a_bench_writes_is_in_the_doc():
    in_doc = set(marked_sections(doc()))
    writers = section_names_in_code()
    assert {"machine.py", "attention.py", "gemm.py", "engine.py", "kv_import.py", "sim.py"} <= set(writers)
    for module, names in writers.items():
        for name in names:
            if "{" in name:  # a template (e.g. the simulator's instance count): at least one run of it
                pattern = re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(name)) + "$")
                assert any(pattern.match(n) for n in in_doc), f"{module}: no section like {name!r}"
            else:
                assert name in in_doc, f"{module} writes {name!r}, which docs/benchmarks.md does not have"


def _command(section: str) -> str:
    m = re.search(r"^Command: `(.+?)`", section, re.MULTILINE)
    assert m, f"no Command line in {section[:80]!r}"
    return m.group(1)


@pytest.mark.parametrize("name", sorted(marked_sections(doc())))
def test_each_section_names_a_command_of_this_repo_that_writes_it_back(name):
    argv = shlex.split(_command(marked_sections(doc())[name]))
    if argv[:2] == ["kvmesh", "bench"]:
        assert argv[2] in BENCHES, f"{name}: no `kvmesh bench {argv[2]}`"
    elif argv[:2] == ["kvmesh", "sim"]:
        assert "--write" in argv, f"{name}: the simulator writes only with --write"
    else:
        assert argv[:2] == ["python", "-m"] and importlib.util.find_spec(argv[2]), f"{name}: {argv[:3]}"
    for flag in ("--doc", "--section"):  # a name given on the command line is the section it writes
        if flag in argv:
            assert argv[argv.index(flag) + 1] == name


def test_a_rerun_replaces_its_own_section_and_leaves_the_rest_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "machine", lambda: "test machine")
    copy = tmp_path / "benchmarks.md"
    copy.write_text(doc())
    name = next(iter(marked_sections(doc())))
    report.write_section(name, "kvmesh bench something", "| a |\n|---|\n| 1 |\n", doc=copy)
    before, after = marked_sections(doc()), marked_sections(copy.read_text())
    assert after[name].startswith(f"<!-- bench:{name}:start -->\n{report.HEADING} {name}\n\n"
                                  "Command: `kvmesh bench something`  \nMachine: test machine  \n")
    assert "| 1 |\n<!-- bench:" in after[name]
    assert copy.read_text().replace(after[name], before[name]) == doc()


def test_a_section_the_doc_lacks_is_appended_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "machine", lambda: "test machine")
    copy = tmp_path / "benchmarks.md"
    copy.write_text(doc())
    report.write_section("A new bench", "kvmesh bench new", "figures", doc=copy)
    text = copy.read_text()
    original = doc().rstrip("\n")
    assert text.startswith(original)
    added = text[len(original):]
    assert added.startswith(f"\n\n<!-- bench:A new bench:start -->\n{report.HEADING} A new bench\n\n"
                            "Command: `kvmesh bench new`  \nMachine: test machine  \nRun: ")
    assert added.endswith("\n\nfigures\n<!-- bench:A new bench:end -->\n")
