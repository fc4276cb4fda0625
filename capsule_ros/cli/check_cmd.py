"""``capsule-ros check DIR --params NEW.yaml``: which capsules a deployment would invalidate,
and why; whether their recipes can regenerate them; how long that would take, and the
storage it would need. A dry run: only headers are read, nothing is written.

Exit status (a CI gate, docs/model-updates.md, docs/command-line.md): 0 when no capsule
would be lost, 2 when some would (invalidated, and no recipe can regenerate it: each says
why), 3 for bad arguments or files (one line on stderr). Strings from capsule files are
printed quoted (``repr``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.model_update import assessment_json, deployment_args, load_deployment_config, open_source
from capsule_ros.runtime.fingerprint import CAUSES
from capsule_ros.updates.assessment import CheckReport, Fate, check
from capsule_ros.updates.deployment import load_deployment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="capsule directory to check")
    deployment_args(parser)
    parser.add_argument("--steps-per-second", type=float, default=None,
                        help="the new policy's replay rate for the time estimate (default: measured here)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def report_json(report: CheckReport) -> dict:
    """The report as ``--json`` prints it."""
    rows = []
    for checked in report.capsules:
        row = assessment_json(checked.assessment)
        if checked.assessment.fate == Fate.REGENERATE and checked.assessment.recipe is not None:
            row["expected_seconds"], row["new_bytes"] = checked.expected_seconds, checked.new_bytes
        rows.append(row)
    return {"directory": report.directory, "fingerprint": report.fingerprint, "capsules": rows,
            "total": report.total, "valid": report.total - report.invalidated, "invalidated": report.invalidated,
            "by_cause": report.by_cause, "regenerable": report.regenerable, "lost": report.lost,
            "recipe_coverage": report.recipe_coverage, "regeneration_steps": report.regeneration_steps,
            "steps_per_second": report.steps_per_second, "steps_per_second_from": report.steps_per_second_from,
            "expected_seconds": report.expected_seconds, "storage_bytes": report.storage_bytes,
            "header_read_seconds": report.header_read_seconds, "exit": report.exit}


def _text(report: dict) -> str:
    lines = [f"{'capsule':<28} {'episode/step':>12}  {'verdict':<8} {'recipe':<12} regeneration"]
    for row in report["capsules"]:
        where = f"{row['episode']}/{row['step']}" if row["episode"] is not None else "-"
        seconds = row.get("expected_seconds")
        outcome = {"keep": "nothing to do", "lost": "LOST",
                   "regenerate": "regenerate" + (f" (~{seconds:.2f} s)" if seconds is not None else "")}[row["action"]]
        lines.append(f"{row['id']:<28} {where:>12}  {'valid' if row['valid'] else 'invalid':<8} {row['recipe']:<12} "
                     f"{outcome}")
        if not row["valid"]:
            lines.append(f"    why:  {row['why']}")
        if row["action"] == "lost":
            lines.append(f"    lost: {row['reason']}")
    causes = ", ".join(f"{CAUSES.get(k, 'not recorded')} {v}" for k, v in sorted(report["by_cause"].items())) or "-"
    rate = report["steps_per_second"]
    lines += ["",
              f"capsules      {report['total']}: {report['valid']} valid, {report['invalidated']} invalidated "
              f"(by cause: {causes})",
              f"regenerable   {report['regenerable']}; lost (no recipe can rebuild them): {report['lost']}",
              f"recipes       {report['recipe_coverage']:.0%} of the capsules carry a regenerable recipe",
              f"time          {report['regeneration_steps']} steps" + (
                  f" at {rate:,.0f} steps/s ({report['steps_per_second_from']}): ~{report['expected_seconds']:.1f} s"
                  if rate else ""),
              f"storage       {report['storage_bytes']:,} bytes of regenerated state and recipes"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Check the directory; the exit status (errors: ``COMMANDS['check'].guard``)."""
    config = load_deployment_config(args)
    directory = open_source(Path(args.directory), "DIR", config, args.key_file)
    deployment = load_deployment(config)
    try:
        report = report_json(check(directory, deployment, args.steps_per_second))
    finally:
        deployment.close()
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else _text(report))
    if report["exit"]:
        print(f"capsule-ros check: {report['lost']} capsule(s) would be lost", file=sys.stderr)
    return int(report["exit"])


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["check"].main(argv, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
