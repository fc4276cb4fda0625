"""One binding vocabulary for every policy kind: the role each tensor of a policy plays,
which tensor plays it, and which port feeds it.

A kind states its rules as data, a ``BindingRules`` table of ``RoleRule`` rows
(``vocabulary.py``, with the messages in ``wording.py``), and calls ``bind``
(``checks.py``) with what it has read: its tensors (a model's inputs and outputs, a
checkpoint's features, a program's declared inputs and state, as ``Tensor``) and, where
the node's ports feed them, the ports (``ports_of``) and the kind's port map. ``bind``
returns a ``BindingTable`` (every tensor with its role, a state pair's output, the port
feeding it) or raises the kind's ``ConfigError`` naming the setting, port or tensor and
what is allowed, in the kind's ``Wording``. No kind has a checker of its own.

How tensors get their roles (``claims.py``). Rules claim tensors in four rounds, each in
table order:

1. the state pairs (``PairRule``): the entries of the kind's pair setting
   (``'<input>:<output>'``), or, when it is empty, each input whose name fits a pattern
   (``'{}_in'`` -> ``'{}_out'``) with the output the pattern names;
2. rules with ``labels`` or ``names``: every tensor of that label (a LeRobot feature
   type, a declared group such as a program's ``input`` / ``state``) and, when ``names``
   is given, of one of those names;
3. OPTIONAL rules: the tensor their setting names, else the first free one with a usual
   name, else none;
4. ONE rules: the tensor their setting names, else the only free one on their side, else
   the free one with a usual name; then rules with neither (an ANY rule takes every
   tensor left on its side: a model's extra outputs).

Then the checks, in this order (a kind reports the first problem, or all of them joined
when its rules say ``Report.ALL``): the pairs; settings that name no free tensor; the
port map against the ports (a port that is not declared, a port that feeds nothing, a
port of the wrong message type); a tensor whose label some rule takes under other names;
a map entry naming no tensor; per rule: count, declared buffer kind, unique and reserved
names, unlabelled tensors left over, dtype and shape, a rule's name on another label;
then tensor by tensor: a label no rule takes, or for a port-fed one: no port, a shape its
feed cannot take, the port's shape and dtype, a port feeding two tensors, a port with a
reserved name.

A VLA kind, for one: its cameras (label VISUAL, ``RGB_IMAGE`` fed by
``IMAGE_MESSAGES``), its joint state (``VECTOR``), its task tokens (a ``Tensor`` the kind
adds, ``TOKENS`` fed by ``TEXT_MESSAGES``, a ``std_msgs/msg/String`` port) and its
action chunk (an output) are four rows of a table (``test/test_binding.py`` has one).

``Requirement`` / ``require`` / ``unmet`` (``requirements.py``) are the same idea for a
kind's options and a checkpoint's configuration: a table of conditions, each with what to
say when it fails.
"""
from __future__ import annotations

from capsule_ros.policies.binding.checks import bind, examine
from capsule_ros.policies.binding.requirements import Requirement, require, unmet
from capsule_ros.policies.binding.vocabulary import (
    ANY_MESSAGES,
    AS_IS,
    IMAGE_MESSAGE,
    IMAGE_MESSAGES,
    RGB_IMAGE,
    TEXT_MESSAGE,
    TEXT_MESSAGES,
    TOKENS,
    VECTOR,
    VECTOR_MESSAGES,
    Binding,
    BindingRules,
    BindingTable,
    Count,
    Feed,
    MessageTypes,
    PairRule,
    Port,
    Report,
    Role,
    RoleRule,
    Side,
    Tensor,
    ports_of,
)
from capsule_ros.policies.binding.wording import Wording

__all__ = [
    "ANY_MESSAGES", "AS_IS", "IMAGE_MESSAGE", "IMAGE_MESSAGES", "RGB_IMAGE", "TEXT_MESSAGE", "TEXT_MESSAGES", "TOKENS",
    "VECTOR", "VECTOR_MESSAGES", "Binding", "BindingRules", "BindingTable", "Count", "Feed", "MessageTypes", "PairRule",
    "Port", "Report", "Requirement", "Role", "RoleRule", "Side", "Tensor", "Wording", "bind", "examine", "ports_of",
    "require", "unmet",
]
