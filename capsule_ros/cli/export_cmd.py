"""``capsule-ros export``: trace a module that keeps the export interface into the ``.pt2``
program ``policy.kind: exported`` serves.

    capsule-ros export --module capsule_gru_policy.export:module --set hidden=64 --out gru.pt2

``--module`` names a module class or a factory function (``package.module:attribute``),
called with the ``--set`` values as keyword arguments (each value read as YAML: numbers,
booleans, lists; anything else is a string). The interface, the checks and the file are
described in ``capsule_ros.policies.export`` and docs/bring-your-own-policy.md.

Exit status 0 when the file was written, 2 with a one-line reason on stderr when not
(docs/command-line.md): ``--out`` is checked before the module is traced, and the file is
written completely or not at all.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.paths import output_file
from capsule_ros.errors import InvalidArgument


def _values(assignments: List[str]) -> Dict[str, Any]:
    """['hidden=64', 'inputs=joints:4'] -> {'hidden': 64, 'inputs': 'joints:4'}."""
    values: Dict[str, Any] = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise InvalidArgument(f"--set {item!r}: must be NAME=VALUE")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        values[name] = "" if value is None else value
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", required=True, help="package.module:factory returning the nn.Module to export")
    parser.add_argument("--set", dest="values", action="append", default=[], metavar="NAME=VALUE",
                        help="keyword argument of the factory (repeatable)")
    parser.add_argument("--out", required=True, type=Path, help="the .pt2 file to write")
    parser.add_argument("--check-steps", type=int, default=8,
                        help="steps the program and the module run side by side to compare (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Export the module; 0 (errors: ``COMMANDS['export'].guard``)."""
    out = output_file(args.out, "--out")
    from capsule_ros.policies.export import InterfaceError, export_module, load_factory
    values = _values(args.values)
    factory = load_factory(args.module)
    try:
        module = factory(**values)
    except Exception as exc:  # noqa: BLE001 - the factory's own refusal, named as such
        raise InterfaceError(f"--module {args.module}: {type(exc).__name__}: {exc}") from None
    report = export_module(module, out, check_steps=args.check_steps,
                           source={"module": args.module, "arguments": values})
    print(report.summary())
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["export"].main(argv, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
