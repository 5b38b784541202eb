"""The argument parser every console script uses: argparse, plus a hint for a mistyped flag.

Python 3.11's argparse answers ``--epoch 3`` with "unrecognized arguments: --epoch 3" and
nothing else; `ArgumentParser` adds "did you mean --epochs?" from the parser's own flags
(difflib's close matches, as Python 3.14's ``suggest_on_error`` does for choices). It lives in
`wire`, the layer every side imports (the monitor imports nothing else), beside
`version.add_version_argument`. Subcommands' parsers are of the same class (argparse makes
them of their parent's class).
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

_UNRECOGNIZED = "unrecognized arguments: "


def flag_hints(message: str, flags: list[str]) -> list[str]:
    """For an argparse "unrecognized arguments" `message`, one hint per mistyped flag that is
    close to one of `flags` ("--epoch: did you mean --epochs?"); [] for any other message."""
    if not message.startswith(_UNRECOGNIZED):
        return []
    hints = []
    for word in message.removeprefix(_UNRECOGNIZED).split():
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    return hints


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose "unrecognized arguments" error names the close flags."""

    def error(self, message: str) -> NoReturn:
        super().error("; ".join([message, *flag_hints(message, _flags(self))]))


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and of its subcommands (a subcommand's unknown flag is reported
    by the top parser: argparse hands the leftovers up)."""
    flags = []
    for action in parser._actions:
        flags += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += _flags(sub)
    return flags
