"""What ``capsule-ros check`` and ``capsule-ros regenerate`` share: the deployment's
arguments (its parameter file), opening the source directory, each path checked before
any work (``capsule_ros.cli.paths``), and the JSON of a capsule's assessment: the
commands' reports are typed (``capsule_ros.updates``) and become JSON only here, at the
edge. Errors become one line and exit status 3 in ``capsule_ros.cli.command``."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.cli.paths import input_dir, input_file
from capsule_ros.errors import ConfigError
from capsule_ros.serving.config import ServingConfig
from capsule_ros.updates.assessment import Assessment


def deployment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, help="the new deployment's parameter file (policy_node's YAML)")
    parser.add_argument("--node-name", default="capsule_policy",
                        help="node whose ros__parameters the file holds (default: %(default)s; /** applies to all)")
    parser.add_argument("--key-file", default=None,
                        help="key-encryption key of encrypted capsules (default: the file's capsules.key_file)")


def load_deployment_config(args: argparse.Namespace) -> ServingConfig:
    """The parameter file's serving config; an error names the file."""
    path = input_file(args.params, "--params")
    if args.key_file:
        input_file(args.key_file, "--key-file")
    try:
        return ServingConfig.from_file(path, args.node_name)
    except ConfigError as exc:
        raise ConfigError(f"--params {str(path)!r}: {exc}") from None


def open_source(path: Path, what: str, config: ServingConfig, key_file: Optional[str]) -> CapsuleDirectory:
    """A capsule directory opened read-only (nothing in it is created, moved or written)."""
    return CapsuleDirectory(input_dir(path, what),
                            key_file=config.capsules.key_file if key_file is None else key_file,
                            max_file_bytes=int(config.capsules.max_file_mb * 2**20), read_only=True)


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
