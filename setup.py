"""The build copies the top-level datasets/ folder into the wheel as speclab/datasets/: the source tree keeps one
copy of the workloads, an installed package carries them (pyproject.toml holds everything else)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithDatasets(build_py):
    def run(self):
        super().run()
        dst = Path(self.build_lib) / "speclab" / "datasets"
        dst.mkdir(parents=True, exist_ok=True)
        for p in sorted((ROOT / "datasets").glob("*.jsonl")):
            shutil.copyfile(p, dst / p.name)


setup(cmdclass={"build_py": BuildWithDatasets})
