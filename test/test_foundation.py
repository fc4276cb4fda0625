"""The package foundation: interfaces, package metadata, idempotent set-up, and the
installed policy_node serving all its services over ROS 2 and exiting cleanly."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from harness import REPO, ClientNode, start_policy_node, wait_for

from capsule_ros.serving.verbs import VERBS


def test_interfaces_share_error_codes_and_response_fields():
    from capsule_ros import msg, srv
    from capsule_ros.errors import ErrorCode
    for name in (verb.srv for verb in VERBS):
        srv_type = getattr(srv, name)
        response = srv_type.Response()
        assert isinstance(response.success, bool) and response.message == "" and response.error_code == 0, name
        for code in ErrorCode:
            assert getattr(srv_type.Response, code.name) == code.value, f"{name}.{code.name}"
    for name in ("Action", "CapsuleInfo", "RuntimeStatus", "CapsuleEvent", "PortStatus"):
        assert getattr(msg, name)() is not None
    assert msg.RuntimeStatus.RUNNING == 1 and msg.CapsuleInfo.TIER_DISK == 2


def test_package_xml_is_format_3_with_rosdep_keys_and_the_version():
    import capsule_ros
    root = ET.parse(REPO / "package.xml").getroot()
    assert root.get("format") == "3"
    assert root.findtext("version") == capsule_ros.__version__
    deps = {e.text for e in root if e.tag.endswith("depend")}
    for key in ("rclpy", "std_msgs", "sensor_msgs", "geometry_msgs", "diagnostic_msgs", "builtin_interfaces",
                "rosidl_default_generators", "rosidl_default_runtime", "python3-numpy", "python3-yaml",
                "python3-pytest", "launch", "launch_ros"):
        assert key in deps, key
    assert root.find("export/build_type").text == "ament_cmake"
    assert root.findtext("member_of_group") == "rosidl_interface_packages"


def _tree_fingerprint(path):
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(path)):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            h.update(f"{full}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _setup():
    return subprocess.run(["bash", str(REPO / "setup.sh")], cwd=REPO, capture_output=True, text=True, timeout=900)


def test_setup_is_idempotent():
    settle = _setup()            # the test command ran it already; this one settles edits made since
    assert settle.returncode == 0, settle.stdout + settle.stderr
    built = [REPO / "install", REPO / ".venv" / "ros-launch"]     # the latter with the launch tooling only
    before = [_tree_fingerprint(path) for path in built]
    start = time.monotonic()
    out = _setup()
    elapsed = time.monotonic() - start
    assert out.returncode == 0, out.stdout + out.stderr
    steps = [line for line in out.stdout.splitlines() if re.search(r"\[setup\] ([1-6]/6|6b) ", line)]
    assert {re.search(r"([1-6])/6|(6b)", line).group(0) for line in steps} == {*(f"{i}/6" for i in range(1, 7)),
                                                                                 "6b"}, out.stdout
    assert all(re.search(r"(exists|up to date|done before|\(Python|skipped \(|not requested)", line)
               for line in steps), out.stdout
    assert [_tree_fingerprint(path) for path in built] == before
    assert elapsed < 30, f"a second set-up took {elapsed:.1f} s"


def test_the_configuration_reference_is_current():
    """docs/configuration.md is what tools/config_reference.py writes from the dataclasses."""
    from capsule_ros.serving.config import settings_reference
    assert (REPO / "docs" / "configuration.md").read_text() == settings_reference(), \
        "docs/configuration.md is stale: run .venv/bin/python tools/config_reference.py"


@pytest.mark.ros
def test_policy_node_serves_every_service_and_exits_on_sigint(tmp_path, rclpy_context):
    from capsule_ros import srv
    node = start_policy_node(tmp_path, namespace="/foundation")
    client = ClientNode(rclpy_context, "foundation_client", node_path="/foundation/capsule_policy")
    try:
        expected = {f"/foundation/capsule_policy/{verb.service}": f"capsule_ros/srv/{verb.srv}" for verb in VERBS}

        def advertised():
            found = {n: t[0] for n, t in client.node.get_service_names_and_types()}
            return all(found.get(n) == t for n, t in expected.items()) and found

        wait_for(advertised, timeout=60, what="the node's services")
        # every verb of the table, in its order; these fields make each request a harmless one
        fields = {"commit": {"label": "foundation"}, "interrupt": {"hold_mode": srv.Interrupt.Request.HOLD_ZERO,
                                                                   "commit": True},
                  "fork": {"label": "branch"}, "drop": {"capsule_id": "nope"}, "save": {"capsule_id": "nope"},
                  "load": {"capsule_id": "nope"}, "record": {"start": False}}
        assert set(fields) <= {verb.name for verb in VERBS}
        for verb in VERBS:
            request = getattr(srv, verb.srv).Request(**fields.get(verb.name, {}))
            response = client.capsules.call(verb.service, request, check=False)
            assert isinstance(response.success, bool) and isinstance(response.error_code, int)
            assert response.message, verb.name
            assert response.success == (response.error_code == 0), (verb.name, response)
        assert node.alive(), node.log()
    finally:
        client.close()
        start = time.monotonic()
        code = node.stop(timeout=10)
        elapsed = time.monotonic() - start
    assert code == 0, node.log()
    assert elapsed < 2.0, f"policy_node took {elapsed:.2f} s to exit after SIGINT"


# ROS-free test modules: what runs on a GPU machine, which has no ROS 2.
ROS_FREE_TESTS = ("test_runtime.py", "test_store.py", "test_fallback.py", "test_session_safety.py",
                  "test_capsule_file.py", "test_capsule_statemachine.py", "test_lerobot_parity.py", "test_sim_arm.py",
                  "test_policy_contract.py", "test_exported.py", "test_session_loop.py", "test_verbs.py",
                  "test_prose.py", "test_chunking.py",
                  "test_lerobot_kinds.py", "test_lerobot_bench.py", "test_lerobot_guide.py", "test_weights.py",
                  "test_onnx.py", "test_session_parts.py")


def test_ros_free_tests_run_without_ros():
    """With every ROS 2 module made unimportable (as on the GPU machine), the ROS-free
    test modules collect, and the session test that once imported rclpy through the test
    harness runs (on the CPU here; `bench/run_gpu.sh` runs the CUDA ones there)."""
    env = {**os.environ, "CAPSULE_ROS_WITHOUT_ROS": "1"}
    files = [str(REPO / "test" / name) for name in ROS_FREE_TESTS]
    no_launch = ["-p", "no:launch_testing", "-p", "no:launch_pytest", "-p", "no:launch_ros"]   # ROS packages too
    collect = subprocess.run([sys.executable, "-m", "pytest", *files, "--collect-only", "-q", "-p", "no:cacheprovider",
                              *no_launch], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-2000:]
    assert int(re.search(r"(\d+) tests collected", collect.stdout).group(1)) >= 100
    run = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "test" / "test_runtime.py"), "-q",
                          "-p", "no:cacheprovider", *no_launch, "-k", "session_rollback_and_recompute and cpu"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]


def test_commands_that_need_no_tensors_do_not_import_torch(tmp_path):
    """`capsule-ros inspect`, `--help` and replay's argument errors answer without torch
    (importing it takes seconds on a small CPU)."""
    capsule = next((REPO / "test" / "fixtures" / "capsules").glob("*.capsule"))
    probe = ("import sys, contextlib, io\n"
             "from capsule_ros.cli.main import main\n"
             "for argv in ({argvs}):\n"
             "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
             "contextlib.redirect_stderr(io.StringIO()):\n"
             "        main(list(argv))\n"
             "print('torch' in sys.modules)\n")
    argvs = repr([["inspect", str(capsule)], ["--help"], ["replay", "--no-such-option"], ["replay", "--help"]])
    result = subprocess.run([sys.executable, "-c", probe.format(argvs=argvs)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "False", result.stdout + result.stderr
