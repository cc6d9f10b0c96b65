"""Build hooks: ship `accel_simulate.pth` at the top of site-packages, in wheels and editable installs.

The .pth line puts a Python process started under `ACCEL_SIMULATE` on a simulated node
(`accel.sim.node.start`); without the variable it costs one environment lookup. Everything
else about the package is in pyproject.toml.
"""

import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "accel_simulate.pth"  # sorts after setuptools' __editable__ files, which make `accel` importable


class BuildPyWithPth(build_py):
    """A wheel holds the .pth next to the packages (the top of site-packages once installed)."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH))


class EditableWheelWithPth(editable_wheel):
    """`pip install -e .`: setuptools' editable wheel, with the .pth added."""

    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*.whl"):
            with zipfile.ZipFile(wheel, "a") as archive:
                if PTH not in archive.namelist():
                    archive.write(PTH, PTH)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
