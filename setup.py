"""Packaging that pyproject.toml cannot say: top-level folders installed inside the package.

kernels/ installs as speclab.kernels and datasets/ as speclab.datasets. In the repository they stay beside the
code that reads them, and neither is ever installed under its own top-level name: ``kernels`` and ``datasets`` are
Hugging Face's libraries, which transformers imports."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["speclab*"]) + ["speclab.datasets", "speclab.kernels"],
      package_dir={"speclab.datasets": "datasets", "speclab.kernels": "kernels"})
