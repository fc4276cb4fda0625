"""``capsule-ros regenerate SRC --params NEW.yaml --out DST``: every capsule of SRC rebuilt
for the deployment of NEW.yaml from its recipe, with a drift report.

Capsules keep their ids, labels, lineage, episodes, steps and stamps; roots and parents
are regenerated before the capsules that start from them; capsules already valid under
the new fingerprint are copied unchanged. DST is written completely or not at all (built
in a hidden sibling directory, renamed at the end; an existing, non-empty DST is refused),
and SRC is opened read-only. Progress goes to stderr when it is a terminal, or with
``--progress``.

Exit status (docs/model-updates.md, docs/command-line.md): 0 all regenerated (or copied)
within the drift bound; 1 drift over ``--max-drift``; 2 some capsule could not be
regenerated (each with its reason; wins over 1); 3 bad arguments or files, or DST could
not be written (one line on stderr; nothing written).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional

from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.model_update import deployment_args, finite_or_inf, load_deployment_config
from capsule_ros.cli.paths import input_dir, probe_dir, replaceable_dir
from capsule_ros.updates.deployment import load_deployment
from capsule_ros.updates.errors import BadArguments
from capsule_ros.updates.regeneration import Outcome, RegenerationReport, Status
from capsule_ros.updates.staging import check_directories, regenerate_directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="capsule directory to regenerate (never written)")
    deployment_args(parser)
    parser.add_argument("--out", metavar="DST", required=True,
                        help="directory to create with the regenerated capsules (absent, or an empty directory)")
    parser.add_argument("--max-drift", type=float, default=None,
                        help="bound on |new action - recorded action| along each recipe (exit 1 above it)")
    parser.add_argument("--progress", action="store_true", help="progress on stderr even when it is not a terminal")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def outcome_json(outcome: Outcome) -> dict:
    return {"id": outcome.capsule_id, "status": outcome.status.value, "reason": outcome.reason,
            "steps": outcome.steps, "drift": finite_or_inf(outcome.drift), "first_step_over": outcome.first_over,
            "seconds": round(outcome.seconds, 6), "recipe_bytes": outcome.recipe_bytes}


def report_json(report: RegenerationReport) -> dict:
    """The report as ``--json`` prints it."""
    return {"source": report.source, "out": report.out, "fingerprint": report.fingerprint,
            "max_drift": report.max_drift, "capsules": [outcome_json(o) for o in report.outcomes],
            **{status.value: report.count(status) for status in Status},
            "drift": finite_or_inf(report.drift), "over_bound": report.over_bound, "exit": report.exit}


def _text(report: dict) -> str:
    lines = [f"{'capsule':<24} {'status':<12} {'steps':>6} {'drift':>10} {'first over':>10}  reason"]
    for row in report["capsules"]:
        drift = row["drift"]
        shown = "-" if drift is None else drift if isinstance(drift, str) else f"{drift:.3g}"
        first = row["first_step_over"] if row["first_step_over"] is not None else "-"
        lines.append(f"{row['id']:<24} {row['status']:<12} {row['steps']:>6} {shown:>10} {first!s:>10}  "
                     f"{row['reason']}")
    lines += ["", f"regenerated {report['regenerated']}, copied {report['copied']}, skipped {report['skipped']}; "
                  f"max drift {report['drift']}" + (f" (bound {report['max_drift']:g}: over it in "
                                                    f"{len(report['over_bound'])} capsule(s))"
                                                    if report["max_drift"] is not None else ""),
              f"written to {report['out']}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Regenerate SRC into DST; the exit status (errors: ``COMMANDS['regenerate'].guard``)."""
    if args.max_drift is not None and not (math.isfinite(args.max_drift) and args.max_drift >= 0):
        raise BadArguments(f"--max-drift {args.max_drift}: must be a finite number >= 0")
    source = input_dir(args.source, "SRC")
    out = replaceable_dir(args.out, "DST")
    check_directories(source, out)                  # DST is not SRC nor in it: before anything is made beside it
    probe_dir(out.parent, "DST", out)
    config = load_deployment_config(args)
    progress = None
    if args.progress or sys.stderr.isatty():
        def progress(text: str) -> None:
            print(f"capsule-ros regenerate: {text}", file=sys.stderr, flush=True)
    report = report_json(regenerate_directory(source, out, lambda: load_deployment(config), max_drift=args.max_drift,
                                              key_file=args.key_file, progress=progress))
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else _text(report))
    return int(report["exit"])


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["regenerate"].main(argv, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
