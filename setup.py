"""pip install of the pure-Python core (no ROS needed), e.g. on a GPU machine:

    pip install .            # runtime, capsules, bag, CLI (capsule-ros bench / inspect / replay --in-process)

The ROS package itself (msg/srv + node) is built by colcon from CMakeLists.txt.
package.xml is the single source of the version; requirements/core.txt of the
dependencies.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def package_xml_version() -> str:
    match = re.search(r"<version>\s*([^<\s]+)\s*</version>", (HERE / "package.xml").read_text())
    if not match:
        raise RuntimeError("package.xml has no <version>")
    return match.group(1)


def core_requirements() -> list:
    lines = (HERE / "requirements" / "core.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="capsule_ros",
    version=package_xml_version(),
    description="Execution-state capsules for PyTorch robot policies: the ROS-free core of capsule_ros",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["capsule_ros", "capsule_ros.*"],
                           exclude=["capsule_ros.ros", "capsule_ros.ros.*", "capsule_ros.bt", "capsule_ros.bt.*"]),
    package_data={"capsule_ros": ["py.typed", "policies/*.safetensors", "policies/*.json"]},
    install_requires=core_requirements(),
    entry_points={"console_scripts": ["capsule-ros = capsule_ros.cli.main:main"]},
)
