"""Packaging that pyproject.toml cannot say: the top-level kernels/ folder installs as speclab.kernels.

The folder stays outside the package in the repository (the layout keeps kernels beside the code that calls them)
and is never installed as a top-level ``kernels``: that name belongs to Hugging Face's kernel library."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["speclab*"]) + ["speclab.kernels"], package_dir={"speclab.kernels": "kernels"})
