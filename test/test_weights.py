"""Weights files (capsule_ros.runtime.weights): safetensors through the library, read
strictly, never unpickled. ROS-free."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.weights import load_weights, read_weights, save_weights

REPO = Path(__file__).resolve().parents[1]


class _Touch:
    """Unpickling this creates ``path``: proof that a file was (or was not) unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_round_trip_keeps_every_dtype_shape_byte_and_the_metadata(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 4, generator=gen), "bf16": torch.randn(5, generator=gen).bfloat16(),
               "i64": torch.arange(7), "u8": torch.randint(0, 256, (2, 3, 3), dtype=torch.uint8, generator=gen),
               "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}
    path = tmp_path / "w.safetensors"
    save_weights(path, tensors, {"seed": 3, "note": "x"})
    assert not (tmp_path / "w.safetensors.part").exists()
    back, metadata = read_weights(path)
    assert metadata == {"seed": "3", "note": "x"}
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("content", ["text", "empty", "truncated", "pickle"])
def test_a_file_that_is_not_safetensors_is_a_config_error_and_never_unpickled(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    sentinel = tmp_path / "unpickled"
    if content == "text":
        path.write_text("not a safetensors file")
    elif content == "empty":
        path.write_bytes(b"")
    elif content == "truncated":
        save_weights(path, {"w": torch.ones(64)})
        path.write_bytes(path.read_bytes()[:-8])
    else:
        path.write_bytes(pickle.dumps({"w": _Touch(sentinel)}))
    with pytest.raises(ConfigError, match="not a valid safetensors file") as err:
        read_weights(path)
    assert str(path) in str(err.value)
    assert ("it is truncated" in str(err.value)) == (content == "truncated"), err.value
    assert not sentinel.exists()


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.safetensors"):
        read_weights(tmp_path / "nowhere.safetensors")


def test_load_is_strict_lists_every_difference_and_changes_nothing(tmp_path):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    wrong = {"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(3), "1.weight": torch.zeros(2, 3),
             "extra": torch.zeros(1)}
    path = tmp_path / "wrong.safetensors"
    save_weights(path, wrong)
    with pytest.raises(ConfigError) as err:
        load_weights(module, path)
    message = str(err.value)
    assert "1 missing (1.bias)" in message and "1 unexpected (extra)" in message
    assert "0.weight: file (3, 5)" in message and "model (3, 4)" in message
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    good = tmp_path / "good.safetensors"
    save_weights(good, {k: torch.full_like(v, 0.5) for k, v in before.items()}, {"k": "v"})
    assert load_weights(module, good) == {"k": "v"}
    assert all(bool((v == 0.5).all()) for v in module.state_dict().values())


def test_the_shipped_policy_file_reads():
    tensors, metadata = read_weights(REPO / "capsule_ros" / "policies" / "arm_reach.safetensors")
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values()) and "seed" in metadata
