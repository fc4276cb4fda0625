"""Every place a capsule verb appears, held against the one verb table
(``capsule_ros.serving.verbs``): the .srv files and the CMake interface list, the session
methods, the node's services, the client's calls, the py_trees leaves, the replay
targets and the replayer's event handlers. A verb added, renamed or given an argument
in one place and not the others fails here."""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import List

import pytest

from capsule_ros.serving.records import EventKind
from capsule_ros.serving.verbs import BY_EVENT, BY_NAME, VERBS, find_verb

REPO = Path(__file__).resolve().parents[1]


def request_fields(srv: str) -> List[str]:
    """The request's field names in a .srv file, in order (constants and comments left out)."""
    request = (REPO / "srv" / f"{srv}.srv").read_text().split("---")[0]
    fields = []
    for line in request.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and "=" not in line:
            fields.append(line.split()[1])
    return fields


def parameters(fn) -> List[str]:
    """Positional-or-keyword parameter names (what a request's fields map to), ``self`` left out."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]


def test_the_table_names_each_verb_service_type_and_event_once():
    assert [v.name for v in VERBS] == ["commit", "reset", "interrupt", "reenter", "fork", "list", "drop", "save",
                                       "load", "record"]
    for key in ("name", "service", "srv"):
        values = [getattr(v, key) for v in VERBS]
        assert len(set(values)) == len(values), key
    # eviction is the store's own, a clock jump the node clock's: neither is a request
    assert set(BY_EVENT) == set(EventKind) - {EventKind.EVICT, EventKind.CLOCK_JUMP}
    assert find_verb("drop_capsule") is find_verb("drop") is BY_NAME["drop"]
    with pytest.raises(KeyError, match="the verbs"):
        find_verb("undo")


def test_the_srv_files_and_the_cmake_interface_list_are_the_tables():
    cmake = (REPO / "CMakeLists.txt").read_text()
    listed = re.search(r"set\(CAPSULE_ROS_INTERFACES(.*?)\)", cmake, re.S).group(1).split()
    assert sorted(p for p in listed if p.startswith("srv/")) == sorted(f"srv/{v.srv}.srv" for v in VERBS)
    assert sorted(p.name for p in (REPO / "srv").glob("*.srv")) == sorted(f"{v.srv}.srv" for v in VERBS)
    for path in [*(REPO / "msg").glob("*.msg"), *(REPO / "action").glob("*.action")]:
        assert f"{path.parent.name}/{path.name}" in listed, path


def test_each_verb_is_the_method_of_its_name_taking_its_requests_fields():
    from capsule_ros.serving.session import SessionVerbs
    for verb in VERBS:
        if verb.session:
            method = getattr(SessionVerbs, verb.name)
        else:                                   # record: the node's, through its facade
            from capsule_ros.ros.facade import NodeFacade
            method = getattr(NodeFacade, verb.name)
        assert parameters(method) == request_fields(verb.srv), verb.name


def test_every_replayed_verb_is_a_replay_target_method_and_a_replayer_handler():
    from capsule_ros.bag.replay import Replayer
    from capsule_ros.bag.targets import InProcessTarget, ReplayTarget
    replayed = [v for v in VERBS if v.replayed]
    assert {v.name for v in replayed} == {"commit", "reset", "interrupt", "reenter", "fork", "drop", "load"}
    protocol = {name for name, value in vars(ReplayTarget).items() if callable(value) and not name.startswith("_")}
    assert {v.name for v in replayed} <= protocol
    for verb in replayed:
        assert set(parameters(getattr(ReplayTarget, verb.name))) <= set(request_fields(verb.srv)), verb.name
        assert callable(getattr(Replayer, f"_{verb.name}")), verb.name
    for name in protocol:
        assert parameters(getattr(InProcessTarget, name)) == parameters(getattr(ReplayTarget, name)), name
    assert not hasattr(Replayer, "_save")       # a replay writes no files: SAVE is not re-enacted


@pytest.mark.ros
def test_the_node_replay_target_implements_the_protocol():
    from capsule_ros.bag.targets import ReplayTarget
    from capsule_ros.ros.replay_target import NodeTarget
    for name, value in vars(ReplayTarget).items():
        if callable(value) and not name.startswith("_"):
            assert parameters(getattr(NodeTarget, name)) == parameters(value), name
    for flag in ("kind", "reenacts_deadline_misses", "stages_without_stepping"):
        assert hasattr(NodeTarget, flag), flag


@pytest.mark.ros
def test_the_services_client_and_leaves_are_built_from_the_table():
    import capsule_ros.bt as bt
    from capsule_ros import srv
    from capsule_ros.bt.behaviours import CapsuleServiceCall
    from capsule_ros.ros.client import CapsuleClient
    from capsule_ros.ros.messages import srv_type
    for verb in VERBS:
        srv_class = getattr(srv, verb.srv)
        assert srv_type(verb) is srv_class
        assert list(srv_class.Request.get_fields_and_field_types()) == request_fields(verb.srv)
        request = CapsuleClient.request(verb)                  # the client's request: the verb's own type
        assert isinstance(request, srv_class.Request)
    commit = CapsuleClient.request(BY_NAME["commit"], "a label", True)
    assert (commit.label, commit.persist, commit.pin) == ("a label", True, False)   # positional: the .srv order
    with pytest.raises(TypeError, match="unknown field"):
        CapsuleClient.request(BY_NAME["drop"], capsule_id="x", form_disk=True)
    with pytest.raises(TypeError, match="at most 1"):
        CapsuleClient.request(BY_NAME["load"], "x", "y")
    leaves = {cls for cls in vars(bt).values() if inspect.isclass(cls) and issubclass(cls, CapsuleServiceCall)
              and cls is not CapsuleServiceCall}
    assert {leaf.__name__ for leaf in leaves} == {"Commit", "Reenter", "Reset", "Interrupt", "Fork", "DropCapsule",
                                                  "SaveCapsule", "LoadCapsule"}
    for leaf_class in leaves:
        leaf = leaf_class()
        assert leaf.verb is find_verb(leaf.service) and leaf.service == leaf.verb.service, leaf_class
        fields = set(inspect.signature(leaf_class).parameters) & {f for v in VERBS for f in request_fields(v.srv)}
        assert fields <= set(request_fields(leaf.verb.srv)), (leaf_class, fields)
    with pytest.raises(ValueError, match="the verbs"):
        CapsuleServiceCall("bad", "undo_capsule")
