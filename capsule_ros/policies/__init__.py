"""Policies served by capsule_ros beyond the reference ones in ``capsule_ros.runtime``,
and the shipped weights of the built-in policies (``*.safetensors`` + ``*.json``)."""
