from setuptools import find_packages, setup

setup(packages=find_packages(include=["speclab*"]) + ["speclab.datasets"],
      package_dir={"speclab.datasets": "datasets"})
