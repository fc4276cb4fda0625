#!/usr/bin/env python3
"""Write docs/configuration.md from the configuration dataclasses:

    .venv/bin/python tools/config_reference.py

test/test_foundation.py checks that the committed file is current.
"""
from pathlib import Path

from capsule_ros.serving.config import settings_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

if __name__ == "__main__":
    DOC.write_text(settings_reference())
    print(f"wrote {DOC}")
