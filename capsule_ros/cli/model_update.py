"""What ``capsule-ros check`` and ``capsule-ros regenerate`` share: the deployment's
arguments (its parameter file), opening the source directory, the exit status of an
error (3: bad arguments or files, with one line on stderr), and the JSON of a capsule's
assessment: the commands' reports are typed (``capsule_ros.updates``) and become JSON
only here, at the edge."""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.errors import CapsuleRosError
from capsule_ros.serving.config import ServingConfig
from capsule_ros.updates.assessment import Assessment
from capsule_ros.updates.errors import EXIT_BAD, BadArguments


def deployment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, help="the new deployment's parameter file (policy_node's YAML)")
    parser.add_argument("--node-name", default="capsule_policy",
                        help="node whose ros__parameters the file holds (default: %(default)s; /** applies to all)")
    parser.add_argument("--key-file", default=None,
                        help="key-encryption key of encrypted capsules (default: the file's capsules.key_file)")


def load_deployment_config(args: argparse.Namespace) -> ServingConfig:
    path = Path(args.params).expanduser()
    if not path.is_file():
        raise BadArguments(f"--params {str(path)!r}: no such file")
    return ServingConfig.from_file(path, args.node_name)


def open_source(path: Path, config: ServingConfig, key_file: Optional[str]) -> CapsuleDirectory:
    """A capsule directory opened read-only (nothing in it is created, moved or written)."""
    if not path.expanduser().is_dir():
        raise BadArguments(f"{str(path)!r} is not a directory")
    return CapsuleDirectory(path, key_file=config.capsules.key_file if key_file is None else key_file,
                            max_file_bytes=int(config.capsules.max_file_mb * 2**20), read_only=True)


def run_guarded(command: str, work: Callable[[], int]) -> int:
    """``work``'s exit status; a typed error (a bad parameter file, key or argument) is one
    line on stderr and exit 3, and so is an unexpected one (with its traceback): never 1,
    which a pipeline reads as drift."""
    try:
        return work()
    except CapsuleRosError as exc:
        print(f"capsule-ros {command}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD
    except Exception:  # noqa: BLE001 - a pipeline must not read a crash as exit 1 (drift): traceback, then 3
        traceback.print_exc()
        print(f"capsule-ros {command}: internal error (above); nothing was written", file=sys.stderr)
        return EXIT_BAD


def assessment_json(item: Assessment) -> dict:
    """One capsule's assessment as the commands' JSON reports show it."""
    header, recipe = item.header, item.recipe
    return {"id": item.capsule_id, "label": header.label if header else "",
            "episode": header.episode_id if header else None, "step": header.step if header else None,
            "valid": item.validity.valid, "causes": list(item.validity.causes), "why": item.validity.describe(),
            "format_version": header.version if header else None,
            "recipe": ("none" if recipe is None else "regenerable" if recipe.regenerable else "cut"),
            "recipe_bytes": recipe.nbytes if recipe is not None else 0,
            "recipe_note": recipe.describe() if recipe is not None else "no recipe",
            "action": item.fate.value, "reason": item.reason}


def finite_or_inf(value: Optional[float]) -> object:
    """A drift as JSON carries it: the number, "inf" for one that diverged, or None."""
    return value if value is None or math.isfinite(value) else "inf"
