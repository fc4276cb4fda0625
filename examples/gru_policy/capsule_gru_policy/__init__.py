"""An example capsule_ros policy package: a GRU with an action-chunk queue, registered as
``policy.kind: gru_chunk`` through the entry-point group ``capsule_ros.policies``
(pyproject.toml). docs/bring-your-own-policy.md of capsule_ros walks through it.

- ``model``: the settings section ``policy.gru_chunk`` and the step as a pure module;
- ``policy``: the StatefulPolicy over the arena, and the ``PolicyKind`` the entry point names;
- ``export``: the factory ``capsule-ros export --module capsule_gru_policy.export:module`` calls.
"""
