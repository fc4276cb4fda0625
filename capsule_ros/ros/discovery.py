"""How long a client waits for the first answer of a server it has just discovered.

rclpy's ``service_is_ready()`` (an action client's ``server_is_ready()``) turns true once
the *client* has matched the server's endpoints. The server matches the client's request
writer only once it has discovered the client's participant, and with Fast DDS's
defaults (this project's RMW) that can wait for the client's next periodic announcement,
every 3 s. A request sent before is not lost (the writer is reliable): the server gets it
when it matches the client, and answers it then. A first call given the normal call
timeout (1 s for the behaviour-tree leaves) can so time out against a server that would
answer it, and a state-changing verb can then be applied after the caller gave up
(docs/benchmarks.md, "A restarted node and a long-lived client", has the measurements).

So a client's first call to a server, and its first after it saw the server gone, waits
at least :data:`DISCOVERY_GRACE_S` for its answer; once the server has answered the client,
the caller's own timeout applies (a server that answered has matched the client).
"""
from __future__ import annotations

DISCOVERY_GRACE_S = 5.0          # Fast DDS's announcement period (3 s) with room for a loaded machine


class DiscoveryGrace:
    """The answer timeout of one client (one rclpy service or action client): at least
    ``grace_s`` until the server has answered it, the caller's timeout after that."""

    def __init__(self, grace_s: float = DISCOVERY_GRACE_S):
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = float(grace_s)
        self.answered = False

    def timeout_s(self, call_timeout_s: float) -> float:
        """How long to wait for the answer of a call sent now."""
        return call_timeout_s if self.answered else max(call_timeout_s, self.grace_s)

    @staticmethod
    def note(timeout_s: float, call_timeout_s: float) -> str:
        """What a timeout's message adds when the grace, not the caller, set ``timeout_s``."""
        return " (a first call to a just-discovered server: the discovery grace)" if timeout_s > call_timeout_s else ""

    def on_answer(self) -> None:
        """The server answered this client: it has discovered it."""
        self.answered = True

    def on_server_gone(self) -> None:
        """The client found no server: the next one to appear must discover the client anew."""
        self.answered = False


__all__ = ["DISCOVERY_GRACE_S", "DiscoveryGrace"]
