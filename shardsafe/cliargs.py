"""What every shardsafe command line shares: one-line usage errors, defaults shown in ``--help``, value types.

``shardsafe``, ``python -m shardsafe.launch`` and ``python -m shardsafe.tor`` build their parsers from
:class:`Parser`, and the subcommands they register inherit it, so every command behaves alike:

* a usage error is one line on stderr, ``PROG: error: WHAT (see PROG --help)``, and exit code 2 -- argparse's
  own errors and the ones a command finds after parsing (:func:`usage_error`) alike;
* ``--help`` shows every option's default: appended as ``(default: X)`` unless the help text already says what
  the default is (a default that depends on something else, e.g. an environment variable, is said in words);
* renamed options keep their old spelling as a hidden alias (:func:`hidden_alias`), so scripts keep working.

The value types raise ``argparse.ArgumentTypeError`` with what was expected, so argparse names the option.
Standard library only: the launch commands import it without the rest of shardsafe.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

EXIT_USAGE = 2
"""The exit code of every usage error (argparse's own convention)."""


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, where they say something: not for on/off flags, required or positional arguments, a
    ``None`` default (its help says what happens), or help that already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, "", argparse.SUPPRESS) or action.nargs == 0
                or action.required or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr with exit code 2 (argparse prints the whole
    usage block first, which buries the message in a script's log), and whose help shows the defaults.
    Subparsers made through ``add_subparsers`` are Parsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, one_line(self.prog, message))


def one_line(prog: str, message: str, *, hint: bool = True) -> str:
    """``PROG: error: MESSAGE (see PROG --help)``, on one line, with its newline (``hint=False``: without the
    pointer to --help, for a setting that is well-formed but cannot be honoured here)."""
    flat = " ".join(str(message).split())
    return f"{prog}: error: {flat}" + (f" (see {prog} --help)\n" if hint else "\n")


def usage_error(prog: str, message: str, *, hint: bool = True) -> int:
    """Say a usage error found after parsing as argparse's are said; returns the exit code (2)."""
    sys.stderr.write(one_line(prog, message, hint=hint))
    sys.stderr.flush()
    return EXIT_USAGE


def hidden_alias(parser: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """Accept ``old`` (another spelling of the option ``new``, for command lines written with it) without showing it
    in ``--help``."""
    kwargs = {"dest": new.dest, "help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
    if new.nargs == 0:
        kwargs["action"] = "store_true" if new.const is True else "store_const"
        if kwargs["action"] == "store_const":
            kwargs["const"] = new.const
    else:
        kwargs.update(type=new.type, choices=new.choices, metavar=new.metavar)
    parser.add_argument(old, **kwargs)


def whole(low: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` (``what`` names its unit in the message)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number{' of ' + what if what else ''} "
                                             f">= {low}")
        return v
    parse.__name__ = "whole number"   # argparse names the type in "invalid <type> value"
    return parse


def number(what: str = "", *, positive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0 (> 0 with ``positive``); ``what`` names it in the message."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what + ', ' if what else ''}a finite number "
                                             f"{'> 0' if positive else '>= 0'}")
        return v
    parse.__name__ = "number"
    return parse


seconds = number("seconds")
"""Seconds >= 0 (0 usually means off; the option's help says so)."""

positive_seconds = number("seconds", positive=True)
"""Seconds > 0."""
