"""The scenarios of `edgerun bench NAME`: one per claim in docs/BENCHMARKS.md.

A scenario measures two or more sides of one claim in one run, in turns, so the machine's drift
falls on every side alike (the only fair comparison on a shared or throttling machine), and
states the claim as a paired ratio against its goal. The harness gives each one the same
command-line shape (`edgerun bench NAME [flags] --json PATH`), the same JSON envelope and the
same closing lines: one per claim, `met` or `missed`.

To add a scenario, write a module under edgerun/bench/ that calls `register(Scenario(...))` at
import and add its name to MODULES. Keep its top-level imports light (the CLI imports every
scenario module to build `--help`): import llama.cpp, Textual or the converter inside `run`.

    register(Scenario(
        name="my-claim",                          # edgerun bench my-claim
        help="X vs Y decode tok/s (goal >= 0.98)",  # one line for --help
        add_args=_args,                           # (ArgumentParser) -> None; --json is added for you
        run=_run,                                 # (Namespace, say) -> body (dict, JSON-serializable)
        report=_report,                           # (doc) -> the terminal table (str)
    ))

The body must hold "settings" (what was measured, as the command's flags say) and "claims"
(a list made with `claim(...)`); anything else is the scenario's own data. `interleave` runs
sides in ABBA turns, `count` is the argparse type of a count, `bench.stats` has the medians and
paired ratios, and `ab.run` runs in-process configurations on the shipped prompts. The envelope
the harness adds: schema, scenario, argv, commit, machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import operator
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import ConfigError

SCHEMA = 1
MODULES = ("edgerun.bench.spec", "edgerun.bench.external", "edgerun.bench.host", "edgerun.bench.tui",
           "edgerun.bench.quant", "edgerun.bench.gpu", "edgerun.bench.load",
           "edgerun.bench.serve", "edgerun.bench.resume", "edgerun.bench.rpc", "edgerun.bench.structured")
GOALS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}

Say = Callable[[str], None]


@dataclass(frozen=True)
class Scenario:
    name: str  # the word after `edgerun bench`
    help: str  # one line: what is compared and the goal
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Say], dict]  # measures; returns the body of the JSON document
    report: Callable[[dict], str]  # the terminal table, from the whole document


_REGISTRY: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    """Add a scenario (at its module's import); a second one of the same name is a bug."""
    if scenario.name in _REGISTRY and _REGISTRY[scenario.name] is not scenario:
        raise ValueError(f"two bench scenarios are named {scenario.name!r}")
    _REGISTRY[scenario.name] = scenario
    return scenario


def scenarios() -> dict[str, Scenario]:
    """Every registered scenario by name, in MODULES' order."""
    for module in MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)


def get(name: str) -> Scenario:
    found = scenarios().get(name)
    if found is None:
        raise ConfigError(f"no bench scenario named '{name}'; there are: {', '.join(scenarios())}")
    return found


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """One sub-command per scenario (edgerun bench NAME -h shows its flags)."""
    for s in scenarios().values():
        p = sub.add_parser(s.name, help=s.help.replace("%", "%%"), description=s.help)
        s.add_args(p)
        p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")


# -- what every scenario shares ------------------------------------------------------------------


def count(text: str) -> int:
    """argparse type of a count of 1 or more (argparse prints the one-line error)."""
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return value


def interleave(sides: dict[str, Callable[[], float]], repeat: int, say: Say = lambda line: None,
               unit: str = "tok/s") -> dict[str, list[float]]:
    """Each side once per repeat, in ABBA turns (A B, B A, A B, ...): a drift of the machine during
    a repeat lands on both sides of it, and pairs of repeats cancel its order's bias."""
    values: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            values[name].append(sides[name]())
        say(f"[{rep + 1}/{repeat}] " + ", ".join(f"{n} {values[n][-1]:.2f} {unit}" for n in names))
    return values


def claim(text: str, value: dict | float | None, goal: str) -> dict:
    """A claim's figure against its goal (e.g. '>= 0.97'). `value` is a spread (median, min,
    max over paired repeats: the median is judged) or one number."""
    op, target = goal.split()
    figure = value if isinstance(value, dict) or value is None else {"median": value, "min": value, "max": value}
    met = figure is not None and GOALS[op](figure["median"], float(target))
    return {"claim": text, "goal": goal, "met": met} | (figure or {"median": None, "min": None, "max": None})


def side_lines(sides: dict[str, dict], unit: str = "tok/s") -> list[str]:
    """One line per side: its median and range over the turns."""
    width = max(map(len, sides), default=0)
    return [f"{name:{width}} median {v['median']:.2f} {unit} ({v['min']:.2f}-{v['max']:.2f})" for name, v in sides.items()]


def claim_lines(doc: dict) -> list[str]:
    out = []
    for c in doc["claims"]:
        if c["median"] is None:
            out.append(f"{c['claim']}: not measured (goal {c['goal']})")
            continue
        spread = f" ({c['min']:.3f}-{c['max']:.3f})" if c["min"] != c["max"] else ""
        out.append(f"{c['claim']}: {c['median']:.3f}{spread}, goal {c['goal']}: {'met' if c['met'] else 'missed'}")
    return out


def machine() -> dict:
    """What the figures were measured on: CPU, cores, memory, GPU, and the load when it started."""
    import psutil

    from edgerun.settings import cpu_name, physical_cores

    return {"cpu": cpu_name(), "arch": platform.machine(), "logical_cores": os.cpu_count(),
            "physical_cores": physical_cores(), "ram_bytes": psutil.virtual_memory().total,
            "gpu": _gpus(), "load_avg_1m": os.getloadavg()[0]}


def _gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def commit() -> str | None:
    """The checkout's commit (with '-dirty' when a tracked file of edgerun or native/ differs
    from it), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                "edgerun", "native"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# -- running one -----------------------------------------------------------------------------------


def measure(scenario: Scenario, args: argparse.Namespace, say: Say = lambda line: None) -> dict:
    """Run a scenario: its body inside the harness's envelope."""
    started = {"schema": SCHEMA, "scenario": scenario.name, "argv": shlex.join(sys.argv[1:]),
               "commit": commit(), "machine": machine()}
    body = scenario.run(args, say)
    if "settings" not in body or "claims" not in body:
        raise ValueError(f"scenario {scenario.name} returned no settings or claims")
    return started | body


def main(args: argparse.Namespace, say: Say) -> int:
    """`edgerun bench NAME`: measure, print the table and the claims, write the JSON."""
    from edgerun.convert.atomic import atomic_path

    scenario = get(args.scenario)
    doc = measure(scenario, args, say)
    print("\n".join([scenario.report(doc), "", *claim_lines(doc)]), flush=True)
    if args.json:
        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
    return 0
