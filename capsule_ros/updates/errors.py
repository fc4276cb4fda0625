"""The exit status of ``capsule-ros check`` and ``capsule-ros regenerate``, and the error
of arguments or files they cannot work with (docs/model-updates.md has the table)."""
from __future__ import annotations

from capsule_ros.errors import InvalidArgument

EXIT_OK = 0          # every capsule kept or regenerated (within the drift bound)
EXIT_DRIFT = 1       # some regenerated capsule's actions drifted over the bound
EXIT_LOST = 2        # some capsule cannot be regenerated (wins over EXIT_DRIFT)
EXIT_BAD = 3         # bad arguments or files: nothing written


class BadArguments(InvalidArgument):
    """Arguments or files the commands cannot work with (exit 3)."""
