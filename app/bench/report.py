"""Writing benchmark results into docs/benchmarks.md: one section per benchmark, replaced on each run."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"  # <repo>/app/bench/report.py
HEADER = "# Benchmarks\n\nEach section is written by the command it names; rerun that command to refresh it.\n"
HEADING = "###"  # a bench's section sits under the capability (a ``##`` heading) it measures


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, for a run on a shared machine to state."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_section(name: str, command: str, body: str, doc: Path = DOC) -> Path:
    """Replace the section ``name`` of the benchmark doc (between its ``bench:name`` markers, wherever it sits),
    or append it at the end when the doc has none yet."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"<!-- bench:{name}:start -->\n{HEADING} {name}\n\nCommand: `{command}`  \n"
               f"Machine: {machine()}  \nRun: {stamp}\n\n{body.strip()}\n<!-- bench:{name}:end -->\n")
    text = doc.read_text() if doc.exists() else HEADER
    pattern = re.compile(rf"<!-- bench:{re.escape(name)}:start -->.*?<!-- bench:{re.escape(name)}:end -->\n",
                         re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


def publish(name: str, command: str, body: str, write: bool = True) -> None:
    """Print a bench's results and, when ``write``, make them its section ``name`` of the doc."""
    print(body)
    if write:
        print(f"\nwritten to {write_section(name, command, body)}")
