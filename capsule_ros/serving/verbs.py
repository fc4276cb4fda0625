"""The capsule verbs, each defined once: the table everything else is built from or
checked against.

A verb is one request a behaviour tree (or a person) makes of a policy node: commit,
reset, interrupt, reenter, fork, list, drop, save, load, record. Its row says

- ``name``: the verb's one name: the method of the session's verbs
  (``PolicySession.verbs``) that does it (``record``: the node's recorder), of
  ``capsule_ros.ros.client.CapsuleClient`` that calls it, and of a replay target
  (``capsule_ros.bag.targets.ReplayTarget``) that re-enacts it;
- ``service``: the service's name under the node (``~/<service>``) and ``srv``: its type
  ``capsule_ros/srv/<srv>`` (both are the external contract: README.md's node interface
  and the verb table in docs/architecture.md);
- ``event``: the ``capsule_ros/msg/CapsuleEvent`` kind it publishes when it changes
  something, and ``replayed``: whether ``capsule-ros replay`` re-enacts a recorded one;
- ``idempotent``: whether asking twice leaves the node as asking once and answers the
  same, so a client may send the request again when no answer came (``list``, ``load``);
- ``describe``: the service's ``message`` for a result.

The request's fields (the ``.srv`` file) are the session method's positional-or-keyword
parameters, by name (its keyword-only ones, such as ``interrupt``'s ``timeout_s``, are for
callers in the process): the services hand a request's fields to the method, the client
builds a request from its arguments. Adding an argument to a verb touches the ``.srv`` and
the session method (and the verb table in docs/architecture.md); a replay target's method
takes only what a recorded event carries. ``test/test_verbs.py`` holds the services, the
client, the behaviour-tree leaves, the replay targets and the CMake interface list to this
table.

ROS-free: the ``.srv`` types are named here and resolved by the ROS layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from capsule_ros.errors import InvalidArgument
from capsule_ros.serving.records import EventKind, HoldMode

Describe = Callable[[Any, Mapping[str, Any]], str]     # (the verb's result, the request's fields) -> message
MAX_LABEL = 256                                         # characters of a capsule label (commit, fork)


@dataclass(frozen=True)
class Verb:
    """One row of the table (see the module docstring)."""

    name: str
    service: str
    srv: str
    event: Optional[EventKind]
    idempotent: bool
    describe: Describe
    replayed: bool = False
    session: bool = True            # done by ``PolicySession.verbs.<name>`` (False: by the node itself)


def _commit(capsule: Any, request: Mapping[str, Any]) -> str:
    return f"committed {capsule.id} at step {capsule.step}" + (f", saved to {capsule.path}"
                                                               if request.get("persist") else "")


def _reset(start: Any, request: Mapping[str, Any]) -> str:
    return f"episode {start.episode_id} started from " + (f"capsule {start.capsule.id}" if start.capsule
                                                          else "the initial state")


def _interrupt(capsule: Any, request: Mapping[str, Any]) -> str:
    mode = HoldMode(request.get("hold_mode", HoldMode.HOLD_LAST)).name
    if capsule is None:
        return f"interrupted ({mode})"
    return f"interrupted at step {capsule.step} ({mode}), boundary capsule {capsule.id}"


def _reenter(result: Any, request: Mapping[str, Any]) -> str:
    capsule = result.capsule
    if capsule is None:
        return "resumed the interrupted episode where it stopped"
    verb = "rolled back to" if result.rollback else "re-entered"
    return f"{verb} {capsule.id} (episode {capsule.episode_id}, step {capsule.step})" + (
        f" by recomputation: {result.fallback_reason}" if result.fallback else "")


def _fork(capsule: Any, request: Mapping[str, Any]) -> str:
    return f"forked {capsule.id} from {capsule.parent_id or 'the live state'}"


def _list(capsules: Any, request: Mapping[str, Any]) -> str:
    return f"{len(capsules)} capsule(s)"


def _drop(_result: Any, request: Mapping[str, Any]) -> str:
    return f"dropped {request.get('capsule_id', '')}" + (" from memory and disk" if request.get("from_disk") else "")


def _save(capsule: Any, request: Mapping[str, Any]) -> str:
    return f"saved {capsule.id} to {capsule.path}"


def _load(capsule: Any, request: Mapping[str, Any]) -> str:
    return f"loaded {capsule.id} (episode {capsule.episode_id}, step {capsule.step})"


def _record(result: Any, request: Mapping[str, Any]) -> str:
    if request.get("start"):
        return f"recording to {result.bag_path}"
    return f"wrote {result.messages} messages to {result.bag_path}"


VERBS: Tuple[Verb, ...] = (
    Verb("commit", "commit", "Commit", EventKind.COMMIT, False, _commit, replayed=True),
    Verb("reset", "reset", "Reset", EventKind.RESET, False, _reset, replayed=True),
    Verb("interrupt", "interrupt", "Interrupt", EventKind.INTERRUPT, False, _interrupt, replayed=True),
    Verb("reenter", "reenter", "Reenter", EventKind.REENTER, False, _reenter, replayed=True),
    Verb("fork", "fork", "Fork", EventKind.FORK, False, _fork, replayed=True),
    Verb("list", "list_capsules", "ListCapsules", None, True, _list),
    Verb("drop", "drop_capsule", "DropCapsule", EventKind.DROP, False, _drop, replayed=True),
    Verb("save", "save_capsule", "SaveCapsule", EventKind.SAVE, False, _save),   # a replay writes no files
    Verb("load", "load_capsule", "LoadCapsule", EventKind.LOAD, True, _load, replayed=True),
    Verb("record", "record", "Record", None, False, _record, session=False),
)
BY_NAME: Dict[str, Verb] = {verb.name: verb for verb in VERBS}
BY_SERVICE: Dict[str, Verb] = {verb.service: verb for verb in VERBS}
BY_EVENT: Dict[EventKind, Verb] = {verb.event: verb for verb in VERBS if verb.event is not None}


def find_verb(name_or_service: str) -> Verb:
    """The verb of a name (``drop``) or of a service name (``drop_capsule``); KeyError naming the known ones."""
    found = BY_NAME.get(name_or_service) or BY_SERVICE.get(name_or_service)
    if found is None:
        raise KeyError(f"no capsule verb {name_or_service!r}; the verbs: {[v.name for v in VERBS]}")
    return found


def hold_mode_of(value: int) -> HoldMode:
    """A request's ``hold_mode``; InvalidArgument naming the valid ones."""
    try:
        return HoldMode(value)
    except ValueError:
        raise InvalidArgument(f"hold_mode {value!r}: must be one of {[m.value for m in HoldMode]}") from None


def check_label(label: str) -> None:
    """InvalidArgument unless ``label`` is a string of at most ``MAX_LABEL`` characters."""
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise InvalidArgument(f"label of {len(label) if isinstance(label, str) else '?'} characters: "
                              f"at most {MAX_LABEL}")
