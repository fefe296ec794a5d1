"""What every ``kvxfer`` subcommand shares: its parser, its JSON flags, its progress line.

* :func:`parser` - defaults shown in ``--help`` (and the description kept as written);
* :func:`add_json_args` - ``--json``: a switch, the result as one JSON object on the last
  line of stdout; ``--json-out PATH``: also write that object to ``PATH``;
* :class:`Progress` - a one-line ``[done/total] label`` display on stderr for long runs;
  silent when stderr is not a terminal or ``--json`` was given (so pipes, logs and JSON
  consumers never see it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, TextIO


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, ``(default: ...)`` after every option that has one (an
    option whose default is None explains its default in its own help, if it has one)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def parser(prog: str, description: Optional[str] = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )


def add_json_args(ap: argparse.ArgumentParser, json_out_default: Optional[str] = None) -> None:
    ap.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on the last line of stdout",
    )
    ap.add_argument(
        "--json-out",
        default=json_out_default,
        metavar="PATH",
        help="also write the result as JSON to PATH",
    )


def emit_json(args: argparse.Namespace, obj: Any) -> None:
    """Honour ``--json`` / ``--json-out`` for ``obj`` (anything ``json.dumps`` takes)."""
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True, default=str), flush=True)


class Progress:
    """``with Progress(total, "bench transfer", enabled=...) as p: ... p.step("label")``."""

    def __init__(
        self, total: int, what: str, enabled: Optional[bool] = None, stream: Optional[TextIO] = None
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.total, self.what, self.done = int(total), what, 0
        self._t0 = time.perf_counter()
        self._width = 0

    def step(self, label: str = "") -> None:
        """One unit done (``label``: what comes next, or what just finished)."""
        self.done += 1
        self._show(label)

    def show(self, label: str = "") -> None:
        """Redraw without counting (e.g. before a long unit starts)."""
        self._show(label)

    def _show(self, label: str) -> None:
        if not self.enabled:
            return
        line = (
            f"[{self.done}/{self.total}] {self.what}: {label} "
            f"({time.perf_counter() - self._t0:.0f} s)"
        )
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["HelpFormatter", "Progress", "add_json_args", "emit_json", "parser"]
