"""Port adapters on every supported message type (rclpy messages, no ROS graph needed):
values, shapes, joint-name order, image encodings, and each drop reason."""
from __future__ import annotations

import numpy as np
import pytest

from capsule_ros.errors import ConfigError
from capsule_ros.serving.config import PortConfig
from capsule_ros.serving.ports import PortAdapter, PortDrop


def adapter(**config) -> PortAdapter:
    return PortAdapter("p", PortConfig.from_mapping({"topic": "t", **config}))


def test_joint_state_fields_concatenate_in_order_and_names_reorder():
    from sensor_msgs.msg import JointState
    msg = JointState(name=["elbow", "shoulder"], position=[0.2, 0.1], velocity=[2.0, 1.0])
    plain = adapter(type="sensor_msgs/JointState", fields=["position", "velocity"], shape=[4])
    np.testing.assert_array_equal(plain.accept(msg), np.float32([0.2, 0.1, 2.0, 1.0]))
    named = adapter(type="sensor_msgs/JointState", fields=["position", "velocity"], shape=[4],
                    names=["shoulder", "elbow"])
    np.testing.assert_array_equal(named.accept(msg), np.float32([0.1, 0.2, 1.0, 2.0]))
    with pytest.raises(PortDrop) as drop:
        named.accept(JointState(name=["shoulder"], position=[0.1], velocity=[1.0]))
    assert drop.value.reason == "type" and named.counters.dropped["type"] == 1


def test_imu_pose_point_and_float_array():
    from geometry_msgs.msg import PointStamped, PoseStamped
    from sensor_msgs.msg import Imu
    from std_msgs.msg import Float32MultiArray
    imu = Imu()
    imu.orientation.w, imu.angular_velocity.z, imu.linear_acceleration.x = 1.0, 0.5, 9.8
    values = adapter(type="sensor_msgs/msg/Imu", fields=["orientation", "angular_velocity", "linear_acceleration"],
                     shape=[10]).accept(imu)
    np.testing.assert_array_equal(values, np.float32([0, 0, 0, 1, 0, 0, 0.5, 9.8, 0, 0]))
    pose = PoseStamped()
    pose.pose.position.x, pose.pose.orientation.w = 1.5, 1.0
    np.testing.assert_array_equal(adapter(type="geometry_msgs/msg/PoseStamped", fields=["pose"], shape=[7])
                                  .accept(pose), [1.5, 0, 0, 0, 0, 0, 1])
    point = PointStamped()
    point.point.y = -2.0
    np.testing.assert_array_equal(adapter(type="geometry_msgs/PointStamped", fields=["point.y"], shape=[1])
                                  .accept(point), [-2.0])
    array = Float32MultiArray(data=[float(i) for i in range(6)])
    np.testing.assert_array_equal(adapter(type="std_msgs/Float32MultiArray", fields=["data"], shape=[2, 3])
                                  .accept(array), np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("encoding,channels", [("rgb8", 3), ("bgr8", 3), ("mono8", 1)])
def test_images_by_encoding(encoding, channels):
    from sensor_msgs.msg import Image
    height, width = 4, 5
    src = 1 if encoding == "mono8" else 3
    pixels = np.arange(height * width * src, dtype=np.uint8).reshape(height, width, src)
    step = width * src + 3                                       # padded rows are allowed
    data = np.zeros((height, step), np.uint8)
    data[:, :width * src] = pixels.reshape(height, -1)
    msg = Image(height=height, width=width, encoding=encoding, step=step, data=data.tobytes())
    port = adapter(type="sensor_msgs/Image", fields=["data"], shape=[height, width, channels], dtype="uint8")
    out = port.accept(msg)
    expected = pixels[:, :, ::-1] if encoding == "bgr8" else pixels
    np.testing.assert_array_equal(out, expected)
    bad = Image(height=height, width=width, encoding="rgba8", step=width * 4, data=bytes(height * width * 4))
    with pytest.raises(PortDrop):
        port.accept(bad)
    small = Image(height=2, width=width, encoding=encoding, step=step, data=bytes(2 * step))
    with pytest.raises(PortDrop):
        port.accept(small)
    assert port.counters.dropped["type"] == 1 and port.counters.dropped["shape"] == 1


def test_each_drop_reason_is_counted_and_changes_nothing():
    from sensor_msgs.msg import JointState
    port = adapter(type="sensor_msgs/JointState", fields=["position"], shape=[2])

    def joints(values, sec):
        msg = JointState(position=values)
        msg.header.stamp.sec = sec
        return msg

    port.accept(joints([0.1, 0.2], 10))
    cases = [(joints([0.1], 11), "shape"), (joints([np.nan, 0.2], 12), "nonfinite"),
             (joints([np.inf, 0.2], 13), "nonfinite"), (joints([0.3, 0.4], 9), "out_of_order")]
    for msg, reason in cases:
        with pytest.raises(PortDrop) as drop:
            port.accept(msg)
        assert drop.value.reason == reason
    assert port.counters.dropped == {"shape": 1, "type": 0, "nonfinite": 2, "out_of_order": 1, "future": 0}
    assert port.counters.received == 1
    np.testing.assert_array_equal(port.accept(joints([0.5, 0.6], 14)), np.float32([0.5, 0.6]))


def test_port_config_errors_quote_the_value_and_range():
    with pytest.raises(ConfigError, match=r"^ports.cam.staleness_ms = -1.0: must be >= 0.0"):
        PortConfig.from_mapping({"topic": "t", "staleness_ms": -1.0}, section="ports.cam")
    with pytest.raises(ConfigError, match=r"type = 'nav_msgs/msg/Odometry': must be one of"):
        PortConfig.from_mapping({"topic": "t", "type": "nav_msgs/Odometry"})
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['fieldz'\]"):
        PortConfig.from_mapping({"topic": "t", "fieldz": ["x"]})


@pytest.mark.parametrize("value", [1e39, -1e39, 1e300, 3.5e38])
def test_values_the_buffer_dtype_cannot_hold_are_dropped_as_nonfinite(value):
    """A float64 message value beyond float32's range would become inf in the buffer."""
    from sensor_msgs.msg import JointState
    port = adapter(type="sensor_msgs/JointState", fields=["position"], shape=[2])
    with pytest.raises(PortDrop) as drop:
        port.accept(JointState(position=[value, 0.1]))
    assert drop.value.reason == "nonfinite" and "float32" in str(drop.value)
    assert port.counters.dropped["nonfinite"] == 1 and port.counters.received == 0
    np.testing.assert_array_equal(port.accept(JointState(position=[3.4e38, -3.4e38])),
                                  np.array([3.4e38, -3.4e38], np.float32))


@pytest.mark.parametrize("dtype,good,bad", [("int32", [2**31 - 1, -2**31], [2**31, 0]),
                                            ("uint8", [255, 0], [256, 0]), ("uint8", [0, 1], [-1, 0]),
                                            ("int64", [-2**53, 2**53], [1e19, 0])])
def test_integer_buffers_refuse_values_out_of_their_range(dtype, good, bad):
    from geometry_msgs.msg import PointStamped
    from std_msgs.msg import Float32MultiArray
    port = adapter(type="geometry_msgs/PointStamped", fields=["point.x", "point.y"], shape=[2], dtype=dtype)

    def point(values):
        msg = PointStamped()
        msg.point.x, msg.point.y = float(values[0]), float(values[1])
        return msg
    np.testing.assert_array_equal(port.accept(point(good)), np.array(good, dtype=dtype))
    with pytest.raises(PortDrop) as drop:
        port.accept(point(bad))
    assert drop.value.reason == "nonfinite" and dtype in str(drop.value)
    assert Float32MultiArray is not None


def test_a_future_stamp_is_dropped_without_moving_the_ordering_point():
    from sensor_msgs.msg import JointState
    port = adapter(type="sensor_msgs/JointState", fields=["position"], shape=[1])
    now = 1_000 * 10**9

    def joints(sec):
        msg = JointState(position=[float(sec)])
        msg.header.stamp.sec = sec
        return msg
    port.accept(joints(999), now_ns=now)
    with pytest.raises(PortDrop) as drop:
        port.accept(joints(1000 + 3600), now_ns=now, future_tolerance_ns=10**9)
    assert drop.value.reason == "future" and port.counters.dropped["future"] == 1
    # the correctly stamped messages that follow are accepted: the ordering point did not move
    for sec in (1000, 1001):
        np.testing.assert_array_equal(port.accept(joints(sec), now_ns=sec * 10**9, future_tolerance_ns=10**9),
                                      [float(sec)])
    # within the tolerance is fine (clocks of two machines differ a little)
    port.accept(joints(1002), now_ns=1001 * 10**9 + 500_000_000, future_tolerance_ns=10**9)


def test_reset_ordering_accepts_a_clock_that_jumped_back():
    from sensor_msgs.msg import JointState
    port = adapter(type="sensor_msgs/JointState", fields=["position"], shape=[1])
    msg = JointState(position=[1.0])
    msg.header.stamp.sec = 500
    port.accept(msg)
    msg.header.stamp.sec = 10                 # e.g. a simulator restarted its clock
    with pytest.raises(PortDrop):
        port.accept(msg)
    port.reset_ordering()
    np.testing.assert_array_equal(port.accept(msg), [1.0])
