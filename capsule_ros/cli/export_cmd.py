"""``capsule-ros export``: trace a module that keeps the export interface into the ``.pt2``
program ``policy.kind: exported`` serves.

    capsule-ros export --module capsule_gru_policy.export:module --set hidden=64 --out gru.pt2

``--module`` names a module class or a factory function (``package.module:attribute``),
called with the ``--set`` values as keyword arguments (each value read as YAML: numbers,
booleans, lists; anything else is a string). The interface, the checks and the file are
described in ``capsule_ros.policies.export`` and docs/bring-your-own-policy.md.

Exit status 0 when the file was written, 2 with a one-line reason on stderr when not.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from capsule_ros.errors import CapsuleRosError

EXIT_WRITTEN = 0
EXIT_REFUSED = 2


def _values(assignments: List[str]) -> Dict[str, Any]:
    """['hidden=64', 'inputs=joints:4'] -> {'hidden': 64, 'inputs': 'joints:4'}."""
    values: Dict[str, Any] = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--set {item!r}: must be NAME=VALUE")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        values[name] = "" if value is None else value
    return values


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="capsule-ros export", description=__doc__.splitlines()[0])
    parser.add_argument("--module", required=True, help="package.module:factory returning the nn.Module to export")
    parser.add_argument("--set", dest="values", action="append", default=[], metavar="NAME=VALUE",
                        help="keyword argument of the factory (repeatable)")
    parser.add_argument("--out", required=True, type=Path, help="the .pt2 file to write")
    parser.add_argument("--check-steps", type=int, default=8,
                        help="steps the program and the module run side by side to compare (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        from capsule_ros.policies.export import InterfaceError, export_module, load_factory
        values = _values(args.values)
        factory = load_factory(args.module)
        try:
            module = factory(**values)
        except TypeError as exc:
            raise InterfaceError(f"--module {args.module}: {exc}") from None
        report = export_module(module, args.out, check_steps=args.check_steps,
                               source={"module": args.module, "arguments": values})
    except (CapsuleRosError, ValueError, OSError) as exc:
        print(f"capsule-ros export: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_REFUSED
    print(report.summary())
    return EXIT_WRITTEN


if __name__ == "__main__":
    sys.exit(main())
