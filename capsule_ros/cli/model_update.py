"""What ``capsule-ros check`` and ``capsule-ros regenerate`` share: the deployment's
arguments (its parameter file) and opening the source directory, each path checked
before any work (``capsule_ros.cli.paths``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.cli.paths import input_dir, input_file
from capsule_ros.errors import ConfigError
from capsule_ros.serving.config import ServingConfig


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
