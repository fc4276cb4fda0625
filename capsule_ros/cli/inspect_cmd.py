"""``capsule-ros inspect FILE``: print a capsule file's header and verify every chunk.

Exit status 0 when the file verifies, 2 when it does not (or cannot be verified, e.g. an
encrypted file without ``--key-file``, or cannot be read), with a one-line reason on
stderr (docs/command-line.md). Nothing here
trusts the file: the header is printed only after it validated, and strings from it are
printed quoted (``repr``) so a label cannot carry terminal escapes.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from capsule_ros.capsules.config import CapsuleStoreConfig
from capsule_ros.capsules.fileformat import CapsuleHeader, load_kek, read_header, verify_capsule
from capsule_ros.cli.command import COMMANDS
from capsule_ros.cli.paths import input_file
from capsule_ros.errors import CapsuleRosError, PermissionDenied

EXIT_VALID = 0
EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (also used by the ``capsule-ros`` dispatcher)."""
    parser.add_argument("file", help="capsule file (<id>.capsule)")
    parser.add_argument("--key-file", default="", help="key-encryption key (32 raw bytes, mode 0600) "
                                                       "to verify an encrypted capsule")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--max-mb", type=float, default=CapsuleStoreConfig.max_file_mb,
                        help="largest payload accepted, MiB (default: %(default)s)")


def _text(path: str, header: CapsuleHeader, reason: Optional[str]) -> str:
    last = header.nbytes - (header.chunk_count - 1) * header.chunk_bytes
    rows = [("file", path), ("capsule", header.capsule_id), ("label", repr(header.label)),
            ("parent", header.parent_id or "-"), ("episode", header.episode_id), ("step", header.step),
            ("stamp_ns", header.stamp_ns), ("bytes", header.nbytes), ("fingerprint", header.fingerprint),
            ("numerics", header.numerics or "not recorded"), ("format", f"version {header.version}"),
            ("recipe", _recipe_text(header)),
            ("regenerable", "yes" if header.recipe is not None and header.recipe.regenerable else "no"),
            ("encrypted", "yes (AES-256-GCM)" if header.encrypted else "no (SHA-256 checksums)"),
            ("chunks", f"{header.chunk_count} x {header.chunk_bytes} bytes (last {last})"),
            ("buffers", len(header.schema))]
    lines = [f"{key:<12} {value}" for key, value in rows]
    lines.append(f"  {'offset':>12} {'nbytes':>12}  {'kind':<10} {'dtype':<9} {'shape':<20} name")
    for b in header.schema:
        shape = "x".join(map(str, b.shape)) or "scalar"
        lines.append(f"  {b.offset:>12} {b.nbytes:>12}  {b.kind:<10} {b.dtype:<9} {shape:<20} {b.name!r}")
    lines.append(f"{'verified':<12} " + (f"no: {reason}" if reason else
                                        f"yes: {header.chunk_count} chunk(s), {header.nbytes} bytes"))
    return "\n".join(lines)


def _recipe_text(header: CapsuleHeader) -> str:
    if header.recipe is None:
        return "none" + (" (format version 1)" if header.version == 1 else " (saved with capsules.recipe off)")
    return f"{header.recipe_bytes} bytes: {header.recipe.describe()}"


def _json(path: str, header: Optional[CapsuleHeader], reason: Optional[str], error: Optional[str]) -> str:
    info = None
    if header is not None:
        info = {k: v for k, v in header.to_json().items() if k not in ("wrapped_key", "key_nonce")}
        info["encrypted"] = header.encrypted
        info["numerics"] = header.numerics
        info["format_version"] = header.version
        info["recipe_bytes"] = header.recipe_bytes
        info["regenerable"] = bool(header.recipe is not None and header.recipe.regenerable)
    return json.dumps({"file": path, "valid": reason is None, "reason": reason, "error": error, "header": info},
                      indent=2, sort_keys=True)


def run(args: argparse.Namespace) -> int:
    """Inspect one file; returns the exit status (a file that cannot be read at all:
    ``COMMANDS['inspect'].guard``)."""
    input_file(args.file, "capsule file")
    if args.key_file:
        input_file(args.key_file, "--key-file")
    max_bytes = int(args.max_mb * 2**20)
    header = reason = error = None
    try:
        kek = load_kek(args.key_file) if args.key_file else None
        header = read_header(args.file, max_bytes=max_bytes)
        if header.encrypted and kek is None:
            raise PermissionDenied(f"capsule file {args.file!r} is encrypted: pass --key-file to verify its chunks")
        verify_capsule(args.file, kek=kek, max_bytes=max_bytes)
    except CapsuleRosError as exc:
        error, reason = type(exc).__name__, " ".join(str(exc).split())
    if args.json:
        print(_json(args.file, header, reason, error))
    elif header is not None:
        print(_text(args.file, header, reason))
    if reason is not None:
        print(f"capsule-ros inspect: INVALID ({error}): {reason}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_VALID


def main(argv: Optional[List[str]] = None) -> int:
    return COMMANDS["inspect"].main(argv, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
