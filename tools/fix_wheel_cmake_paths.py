#!/usr/bin/env python3
"""Point the ROS wheels' exported CMake files at this interpreter.

The PyPI ROS 2 wheels were built in a manylinux image whose Python lived under
/opt/python/cp311-cp311; their exported CMake targets still name those include and
site-packages directories, and CMake refuses imported targets with non-existent paths.
Rewrite both strings in $VENV/share/**/*.cmake.

Second, rosidl_generator_py exports the NumPy include directory as a PUBLIC include of
the generated Python extension. On a system install that directory lies outside any
source tree; with the venv inside the repository (.venv) CMake refuses to export a path
"prefixed in the source directory". Only the extension's own build needs that directory,
so it is marked $<BUILD_INTERFACE:...>.

Idempotent: files already fixed are left alone.

Usage: fix_wheel_cmake_paths.py VENV
"""
import sys
import sysconfig
from pathlib import Path

BUILDER_PREFIX = "/opt/python/cp311-cp311"


def main(venv: Path) -> int:
    paths = sysconfig.get_paths()
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    replacements = {
        f"{BUILDER_PREFIX}/include/python3.11": paths["include"],
        f"{BUILDER_PREFIX}/lib/python3.11/site-packages": paths["purelib"],
    }
    numpy_public = "PUBLIC ${Python3_INCLUDE_DIRS} ${Python3_NumPy_INCLUDE_DIRS})"
    numpy_build_only = 'PUBLIC ${Python3_INCLUDE_DIRS} "$<BUILD_INTERFACE:${Python3_NumPy_INCLUDE_DIRS}>")'
    if ver != "3.11":  # a cp312 venv: the wheels were built under cp312
        replacements = {k.replace("311", ver.replace(".", "")).replace("3.11", ver): v
                        for k, v in replacements.items()}
    changed = 0
    for path in sorted((venv / "share").rglob("*.cmake")):
        text = path.read_text(errors="surrogateescape")
        new = text
        for old, repl in replacements.items():
            new = new.replace(old, repl)
        new = new.replace(numpy_public, numpy_build_only)
        if new != text:
            path.write_text(new, errors="surrogateescape")
            changed += 1
    print(f"fixed {changed} CMake file(s) under {venv / 'share'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
