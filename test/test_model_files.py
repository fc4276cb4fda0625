"""A model file that cannot be loaded stops the installed ``policy_node`` at start-up with
exit status 2 and ONE line on stderr that names the file and the real cause; nothing of
ONNX Runtime's own output (its C++ error log, its "EP Error" block, C++ signatures)
reaches stderr or stdout. The node's console shows what it sends to ``/rosout`` at the
same level (INFO by default), so a clean stderr is a clean ``/rosout`` too; with the
node's logger at DEBUG, ONNX Runtime's full message is there, at DEBUG.

The broken files are made here from real exports:

- ``policy.onnx`` + ``policy.onnx.data`` written by torch's TorchScript exporter at opset
  18 (no constant folding, so ONNX Runtime's optimiser reads the weights) and saved with
  its weights in an external data file, the ``.data`` then cut to half; and the same cut
  on the fixture torch's dynamo exporter wrote (test/fixtures/onnx/rsl_rl_lstm_dynamo).
  ONNX Runtime's own report of it is a C++ function signature with the reason at the end;
- a model with an operator no runtime implements (ONNX Runtime's refusal, in one line);
- a text file named ``policy.onnx``; the rsl_rl fixture's ``policy.onnx`` cut to half;
- a ``.pt2`` from ``capsule-ros export``'s code (``export_module``) cut to two thirds;
- the shipped ``arm_reach.safetensors`` (``policy.weights``) cut to half;
- a LeRobot ACT checkpoint whose ``model.safetensors`` is cut to half.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Dict, Tuple

import pytest
import torch
import yaml
from harness import REPO
from lerobot_fixtures import Fixture
from runtime_fixtures import RunningSum

pytestmark = pytest.mark.ros
ONNX_PARAMS = REPO / "config" / "onnx_quadruped.yaml"
POLICY_PARAMS = REPO / "config" / "policy.yaml"
RSL_RL = REPO / "test" / "fixtures" / "onnx" / "rsl_rl_lstm"
DYNAMO = REPO / "test" / "fixtures" / "onnx" / "rsl_rl_lstm_dynamo"
ONNXRUNTIME_OUTPUT = re.compile(r"onnxruntime_src|\[E:onnxruntime|EP Error|std::|\.cc:\d+|Traceback")


def cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])
    return path


class LstmPolicy(torch.nn.Module):
    """obs [1, 48], h and c [1, 1, 64] -> actions [1, 12], new h and c."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(48, 64)
        self.head = torch.nn.Linear(64, 12)

    def forward(self, obs, h, c):
        out, (h_out, c_out) = self.lstm(obs.unsqueeze(0), (h, c))
        return self.head(out[0]), h_out, c_out


def torchscript_export_with_external_data(directory: Path) -> Path:
    """The LSTM policy exported at opset 18, its weights in ``policy.onnx.data``."""
    import onnx
    directory.mkdir()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = LstmPolicy().eval()
    single = directory / "single.onnx"
    torch.onnx.export(module, (torch.zeros(1, 48), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)), str(single),
                      input_names=["obs", "h_in", "c_in"], output_names=["actions", "h_out", "c_out"],
                      opset_version=18, dynamo=False, do_constant_folding=False)
    model = onnx.load(str(single))
    single.unlink()
    onnx.save_model(model, str(directory / "policy.onnx"), save_as_external_data=True, location="policy.onnx.data",
                    size_threshold=0)
    assert (directory / "policy.onnx.data").stat().st_size > 100_000
    return directory / "policy.onnx"


def data_cut(model: Path) -> Path:
    """``model`` with its ``.data`` file cut to half."""
    cut(model.with_name(model.name + ".data"), 0.5)
    return model


def unknown_operator(path: Path) -> Path:
    """The rsl_rl fixture with its first node an operator of a domain no runtime has."""
    import onnx
    from onnx import helper
    model = onnx.load(str(RSL_RL / "policy.onnx"))
    model.graph.node[0].op_type, model.graph.node[0].domain = "Teleport", "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(model, str(path))
    return path


def onnx_case(model: Path) -> Tuple[Path, dict]:
    return ONNX_PARAMS, {"policy": {"onnx": {"model": str(model)}}, "runtime": {"device": "cpu"}}


def exported_case(program: Path) -> Tuple[Path, dict]:
    return POLICY_PARAMS, {"policy": {"kind": "exported", "weights": "", "exported": {"program": str(program)}},
                           "runtime": {"device": "cpu"}}


def truncated_program(tmp: Path) -> Path:
    from capsule_ros.policies.export import export_module
    path = tmp / "policy.pt2"
    export_module(RunningSum(), path, check_steps=1)
    return cut(path, 2 / 3)


def lerobot_case(tmp: Path) -> Tuple[Path, dict]:
    fixture = Fixture.load("act_queue", tmp)
    cut(fixture.checkpoint / "model.safetensors", 0.5)
    return POLICY_PARAMS, fixture.node_params()


# name: (tmp -> (parameter file, overlay), the file the line names, the cause it gives)
CASES: Dict[str, Tuple[Callable[[Path], Tuple[Path, dict]], str, str]] = {
    "onnx external data cut (TorchScript exporter, opset 18)": (
        lambda t: onnx_case(data_cut(torchscript_export_with_external_data(t / "ts"))),
        "policy.onnx", r"external data file 'policy\.onnx\.data' is truncated: initializer '[^']+' is bytes \d+"),
    "onnx external data cut (dynamo exporter)": (
        lambda t: onnx_case(data_cut(Path(shutil.copytree(DYNAMO, t / "dyn")) / "policy.onnx")),
        "policy.onnx", r"external data file 'policy\.onnx\.data' is truncated"),
    "onnx operator no runtime has": (
        lambda t: onnx_case(unknown_operator(t / "teleport.onnx")),
        "teleport.onnx", r"ONNX Runtime cannot load it on CPUExecutionProvider: .*com\.example:Teleport\(-1\) is not "
                         r"a registered function/op$"),
    "not onnx": (
        lambda t: onnx_case(Path(shutil.copy(REPO / "README.md", t / "readme.onnx"))),
        "readme.onnx", r"not a readable ONNX model, the file is truncated or not ONNX"),
    "onnx cut": (
        lambda t: onnx_case(cut(Path(shutil.copy(RSL_RL / "policy.onnx", t / "cut.onnx")), 0.5)),
        "cut.onnx", r"not a readable ONNX model, the file is truncated or not ONNX"),
    "pt2 cut": (
        lambda t: exported_case(truncated_program(t)),
        "policy.pt2", r"a \.pt2 archive cut short: the file is truncated"),
    "safetensors weights cut": (
        lambda t: (POLICY_PARAMS, {"policy": {"weights": str(cut(Path(shutil.copy(
            REPO / "capsule_ros" / "policies" / "arm_reach.safetensors", t / "arm.safetensors")), 0.5))},
            "runtime": {"device": "cpu"}}),
        "arm.safetensors", r"not a valid safetensors file: it is truncated \(its header describes \d+ bytes, the "
                           r"file has \d+\)"),
    "lerobot checkpoint weights cut": (
        lerobot_case, "model.safetensors", r"not a valid safetensors file: it is truncated"),
}


def start(params_file: Path, overlay: dict, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    from capsule_ros.ros.processes import installed_executable
    overlay = {**overlay, "capsules": {"directory": str(tmp / "capsules")}}
    path = tmp / "overlay.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": overlay}}))
    return subprocess.run([installed_executable("policy_node"), "--ros-args", "--params-file", str(params_file),
                           "--params-file", str(path), *extra], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_file_that_cannot_be_loaded_is_refused_in_one_line(name, tmp_path):
    make, named, cause = CASES[name]
    params_file, overlay = make(tmp_path)
    result = start(params_file, overlay, tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    shown = f"exit {result.returncode}\nstderr:\n{result.stderr[-4000:]}\nstdout:\n{result.stdout[-2000:]}"
    assert result.returncode == 2, shown
    assert len(lines) == 1 and lines[0].startswith("policy_node: invalid configuration: "), shown
    assert named in lines[0] and re.search(cause, lines[0]), f"/{cause}/ and {named!r} not in: {lines[0]}"
    assert not ONNXRUNTIME_OUTPUT.search(result.stderr + result.stdout), shown


def test_onnxruntimes_own_message_is_kept_at_debug(tmp_path):
    """``--log-level capsule_policy:=debug``: the refusal's line still ends the output, and ONNX Runtime's
    full message is logged before it at DEBUG (for a bug report)."""
    params_file, overlay = onnx_case(unknown_operator(tmp_path / "teleport.onnx"))
    result = start(params_file, overlay, tmp_path, "--log-level", "capsule_policy:=debug")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and lines[-1].startswith("policy_node: invalid configuration: "), \
        result.stderr[-3000:]
    debug = [line for line in lines if line.startswith("[DEBUG]") and "ONNX Runtime on CPUExecutionProvider" in line]
    assert len(debug) == 1 and "[ONNXRuntimeError]" in debug[0] and "Teleport" in debug[0], result.stderr[-3000:]
    assert not any(line.startswith(("[INFO]", "[WARN]", "[ERROR]")) and "ONNXRuntimeError" in line for line in lines)
