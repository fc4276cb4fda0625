"""The ROS 2 layer: the node, its parameters, status, client, simulated arm (needs rclpy)."""
