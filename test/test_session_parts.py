"""The session's shape, held as invariants (docs/architecture.md, "Invariants").

- ``PolicySession`` has at most 12 public methods and properties and no public attribute:
  what its owner decides is one frozen ``SessionOptions``, given at construction.
- No serving part receives a session method: nothing reachable from the parts a session
  composes (its control loop, episode state machine, capsule set, recompute fallback,
  store, runtime) is the session, one of its faces, or a function bound to or closing over
  them, so a part cannot call back into the session (test_layers.py holds the other half:
  only serving/session.py enters the boundary).
- Every status field comes from ``SessionStatus``: ``ros/status.py`` builds ``~/status``
  and ``/diagnostics`` from a picture alone, nothing in ``ros/`` reads a session's parts,
  and the message carries the picture's values.
- No module of ``serving/`` is over 450 lines.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any, Iterator, List, Set

import pytest
from runtime_fixtures import default_config, feed, observations

from capsule_ros.serving.factory import build_session
from capsule_ros.serving.options import SessionOptions
from capsule_ros.serving.records import SessionStatus
from capsule_ros.serving.session import PolicySession

PACKAGE = Path(__file__).resolve().parents[1] / "capsule_ros"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A session with every option that takes a callable (its owner's, as the node's are)."""
    events, published = [], []
    made = build_session(default_config(tmp_path_factory.mktemp("parts"), deadline_ms=50.0),
                         options=SessionOptions(on_event=events.append, on_safe_action=published.append))
    feed(made, observations(5, seed=3))
    made.verbs.commit("a capsule", persist=True)
    yield made
    made.release()


def test_the_session_has_at_most_12_public_members_and_no_public_attribute(session):
    public = sorted(name for name in dir(PolicySession) if not name.startswith("_"))
    assert len(public) <= 12, public
    assert all(callable(getattr(PolicySession, name)) or isinstance(getattr(PolicySession, name), property)
               for name in public), public
    assert [name for name in vars(session) if not name.startswith("_")] == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        SessionOptions().clock_ns = lambda: 0        # type: ignore[misc]


def _reachable(roots: List[Any]) -> Iterator[Any]:
    """Every object reachable from ``roots`` through the package's objects: their attributes,
    containers, bound methods' owners and closures' cells (torch and numpy values end a path)."""
    seen: Set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif inspect.ismethod(obj):
            todo.append(obj.__self__)
        elif inspect.isfunction(obj):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None)
        elif type(obj).__module__.startswith("capsule_ros"):
            todo.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            todo.extend(getattr(obj, slot) for slot in getattr(type(obj), "__slots__", ()) if hasattr(obj, slot))


def test_no_serving_part_receives_a_session_method(session):
    faces = {id(session), id(session.verbs), id(session.loop)}
    found = []
    for obj in _reachable(list(session.parts)):
        if id(obj) in faces:
            found.append(f"a part holds {type(obj).__name__}")
        elif inspect.ismethod(obj) and id(obj.__self__) in faces:
            found.append(f"a part holds {type(obj.__self__).__name__}.{obj.__name__}")
    assert found == []
    # the walk does reach the owner's callbacks (so it would see a session method among them)
    reached = {getattr(obj, "__qualname__", "") for obj in _reachable(list(session.parts)) if callable(obj)}
    assert {"list.append", "Events.evicted"} <= reached, reached


def test_ros_status_is_built_from_a_session_status_alone():
    source = (PACKAGE / "ros" / "status.py").read_text()
    tree = ast.parse(source)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not {"session", "PolicySession"} & names
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "capsule_ros.serving.session" not in imported
    for path in sorted((PACKAGE / "ros").rglob("*.py")):
        text = path.read_text()
        assert "session.runtime." not in text and ".parts." not in text, path


def test_every_status_field_comes_from_the_session_status(session):
    pytest.importorskip("capsule_ros.msg", reason="the status message needs the built ROS interfaces; the picture "
                                                  "itself is covered by test_session_loop.py")
    from capsule_ros.msg import RuntimeStatus
    from capsule_ros.ros.status import runtime_status
    assert list(inspect.signature(runtime_status).parameters.values())[0].annotation in ("SessionStatus",
                                                                                         SessionStatus)
    picture = session.status()
    msg = runtime_status(picture, None)
    assert (msg.episode_state, msg.episode_id, msg.step, msg.lineage) == (int(picture.state), picture.episode_id,
                                                                         picture.step, picture.lineage)
    assert (msg.device, msg.fingerprint, msg.graph_captured) == (picture.device, picture.fingerprint,
                                                                 picture.graph_captured)
    assert (msg.steps_run, msg.deadline_misses, msg.capsules_device) == (picture.counters.steps,
                                                                         picture.counters.deadline_misses,
                                                                         picture.capsules[0])
    assert [p.name for p in msg.ports] == [p.name for p in picture.ports]
    node_owned = {"header", "lifecycle_state", "actions_published"}
    assert node_owned <= set(RuntimeStatus.get_fields_and_field_types())


def test_no_serving_module_is_over_450_lines():
    long = {path.name: n for path in sorted((PACKAGE / "serving").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > 450}
    assert long == {}
