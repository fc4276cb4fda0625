"""Package metadata with package.xml as the single source of truth."""
import importlib.metadata
import re
from pathlib import Path

_PACKAGE_XML_VERSION = re.compile(r"<version>\s*([^<\s]+)\s*</version>")


def version() -> str:
    """The package version: from the build (colcon writes ``_version.py`` from
    package.xml), from pip's metadata (setup.py reads package.xml), or from the
    package.xml beside a source checkout."""
    try:
        from capsule_ros._version import __version__  # written by CMakeLists.txt
        return __version__
    except ImportError:
        pass
    try:
        return importlib.metadata.version("capsule_ros")
    except importlib.metadata.PackageNotFoundError:
        pass
    package_xml = Path(__file__).resolve().parents[1] / "package.xml"
    if package_xml.is_file():
        match = _PACKAGE_XML_VERSION.search(package_xml.read_text())
        if match:
            return match.group(1)
    return "0+unknown"
