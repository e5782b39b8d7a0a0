"""`edgerun` called in the test's own process: `edgerun.cli.main(argv)` with pytest's capsys, for
tests of what the command says and how it exits. The argument parsing, the command and the edge that
turns an edgerun error into one line and an exit status are the same code a subprocess runs; what
an interpreter start adds (about 0.4 s a call on a 2-core CPU) is left to the few tests whose
subject is the process itself (stdout piped into a closed reader, a signal, an RSS figure)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from edgerun import cli


@dataclass(frozen=True)
class Result:
    """What one call did, shaped like subprocess.CompletedProcess."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> Result:
    """Run `edgerun ARGS` through cli.main; argparse's SystemExit becomes the exit status. The
    logger levels the CLI sets for a process are put back, so later tests see the defaults."""
    loggers = [logging.getLogger(name) for name in ("edgerun.llama", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    capsys.readouterr()  # only this call's output
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    out, err = capsys.readouterr()
    return Result(code, out, err)


def one_line_error(result, *needles: str) -> str:
    """The single `edgerun: error:` line of a failed call (a Result or a CompletedProcess), which
    must contain each needle; no traceback, a status above 0."""
    assert result.returncode > 0, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("edgerun: error:")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]
