"""cudelta's build: metadata lives in pyproject.toml; what to build is decided in installer/.

`pip install cudelta` (the sdist) runs bdist_wheel, which installs a verified prebuilt wheel for
this machine or compiles locally (installer/commands.py). The release matrix runs
`CUDELTA_RELEASE_BUILD=1 python setup.py bdist_wheel` for the full fat binary.
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from installer.commands import build_requirements, cmdclass  # noqa: E402  (installer/ ships in the sdist only)

setup(cmdclass=cmdclass(), setup_requires=build_requirements())
