"""What every ``capsule-ros`` subcommand shares: its documented exit statuses (``--help``
prints them; docs/command-line.md lists them all), its argument parser, and the one place
where an error becomes ONE line on stderr and the command's exit status.

A command that cannot do its work (bad arguments, an unusable path, a file that is not
what its name says, a full disk, a node that refuses) prints ``capsule-ros COMMAND:
reason`` as the last line on stderr and exits with its ``refused`` status, never with a
traceback: typed errors (``CapsuleRosError``, ``OSError``) in their own words, anything
else as an internal error with its type. ``CAPSULE_ROS_TRACEBACK=1`` prints the traceback
before that line (for a bug report). Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, List, NoReturn, Optional, Tuple

from capsule_ros.errors import CapsuleRosError, one_line

# Typed errors of layers the command line imports only when it runs (ROS): one line too.
FOREIGN_TYPED = ("capsule_ros.ros.client.ServiceError",)
INTERRUPTED = 130


def _typed(exc: BaseException) -> bool:
    if isinstance(exc, (CapsuleRosError, OSError)):
        return True
    return any(f"{kind.__module__}.{kind.__qualname__}" in FOREIGN_TYPED for kind in type(exc).__mro__)


def reason(exc: BaseException) -> str:
    """The one line an error prints after ``capsule-ros COMMAND: ``: a typed error's own
    words (they name the argument or file), anything else as an internal error."""
    if _typed(exc):
        return one_line(exc)
    return f"internal error ({type(exc).__name__}: {one_line(exc)}); CAPSULE_ROS_TRACEBACK=1 prints the traceback"


class _Parser(argparse.ArgumentParser):
    """argparse that exits with the command's refusal status (argparse's own is 2, which
    some commands use for a verdict)."""

    refused = 2

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(self.refused, f"{self.prog}: {' '.join(message.split())}\n")


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, description, exit statuses and refusal status."""

    name: str
    description: str
    exits: Tuple[Tuple[int, str], ...]       # (status, meaning), as --help and the docs list them
    refused: int                             # the status of an error (one of ``exits``)

    def __post_init__(self) -> None:
        assert self.refused in dict(self.exits), (self.name, self.refused)

    @property
    def prog(self) -> str:
        return f"capsule-ros {self.name}"

    def epilog(self) -> str:
        return "exit status: " + "; ".join(f"{code} {text}" for code, text in self.exits) + \
            " (docs/command-line.md)"

    def parser(self, description: Optional[str] = None) -> argparse.ArgumentParser:
        parser = _Parser(prog=self.prog, description=description or self.description, epilog=self.epilog())
        parser.refused = self.refused
        return parser

    def fail(self, exc: BaseException) -> int:
        """Print ``exc`` as the command's one line; the refusal status."""
        if os.environ.get("CAPSULE_ROS_TRACEBACK"):
            traceback.print_exception(exc)
        print(f"{self.prog}: {reason(exc)}", file=sys.stderr, flush=True)
        return self.refused

    def guard(self, work: Callable[[], int]) -> int:
        """``work()``'s status; any error as one line and ``refused`` (the module docstring)."""
        try:
            return int(work() or 0)
        except KeyboardInterrupt:
            print(f"{self.prog}: interrupted", file=sys.stderr, flush=True)
            return INTERRUPTED
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                raise                               # a status chosen on purpose (argparse: --help, usage)
            print(f"{self.prog}: {' '.join(str(exc.code).split())}", file=sys.stderr, flush=True)
            return self.refused
        except Exception as exc:  # noqa: BLE001 - the one place errors become a line and a status
            return self.fail(exc)

    def main(self, argv: Optional[List[str]], add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int], description: Optional[str] = None) -> int:
        """Parse ``argv`` (a usage error exits ``refused``) and run, guarded; ``description``:
        what --help says above the options (default: the command's one line)."""
        parser = self.parser(description)
        add_arguments(parser)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else self.refused
        return self.guard(lambda: run(args))


REFUSED = "refused: bad arguments, or a path that cannot be used (one line says which and why)"
COMMANDS = {command.name: command for command in (
    Command("demo", "the main job: sim + policy node + scripted capsule plan + report",
            ((0, "the run passed every check"), (1, "a check of the run failed (summary.json lists it)"),
             (2, f"{REFUSED}, or policy_node could not start; nothing was run")), refused=2),
    Command("replay", "replay a rosbag step by step and verify the actions",
            ((0, "every recorded action in scope bit-identical"), (1, "a divergence (with --verify)"),
             (2, f"{REFUSED}: a bad bag, a replay that cannot start, or nothing verified"),
             (3, "no divergence, but some actions skipped (with --verify, unless --partial)")), refused=2),
    Command("record", "record the node's topics into a rosbag2",
            ((0, "the bag was written (its path is the one line on stdout)"),
             (2, f"{REFUSED}, no ROS 2, the node did not answer, or it could not write the bag (nothing of the bag "
                 "is left)")), refused=2),
    Command("inspect", "print and verify a capsule file",
            ((0, "the file verifies"),
             (2, "it does not, or cannot be verified (an encrypted file without --key-file), or " + REFUSED)),
            refused=2),
    Command("export", "trace a policy module into a .pt2 program (policy.kind: exported)",
            ((0, "the program was written"),
             (2, f"{REFUSED}, the module breaks the export interface, or --out could not be written; nothing was "
                 "written")), refused=2),
    Command("check", "which capsules a new deployment would invalidate, and why (CI gate)",
            ((0, "no capsule would be lost"), (2, "some capsule would be lost (each says why)"),
             (3, f"{REFUSED}; nothing was written")), refused=3),
    Command("regenerate", "rebuild a capsule directory for a new deployment from its recipes, with a drift report",
            ((0, "every capsule regenerated (or copied) within the drift bound"), (1, "drift over --max-drift"),
             (2, "some capsule could not be regenerated (each with its reason; wins over 1)"),
             (3, f"{REFUSED}, or DST could not be written (a full disk...); nothing was written")), refused=3),
    Command("bench", "benchmarks (one JSON object with --json)",
            ((0, "measured"), (2, f"{REFUSED}, or the benchmark could not run")), refused=2),
)}
