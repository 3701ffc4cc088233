"""rlrec has no compiled parts: everything is configured in pyproject.toml.

This file stays so that `pip install .` and the Dockerfile keep one entry point; the recorder's
hot path is plain Python (see producer/recorder.py), so the install needs no C compiler.
"""

from setuptools import setup

setup()
