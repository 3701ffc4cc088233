"""The one compiled part of rlrec: the recorder's column stacking (producer/_stack.c).

Everything else is configured in pyproject.toml. The extension is optional: where no C
compiler is at hand the install goes on without it and the recorder stacks in Python
(same bytes, more CPU per step); `rlrec.producer.recorder.ACCELERATED` says which is used.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rlrec.producer._stack",
            ["producer/_stack.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        )
    ]
)
