"""rlrec's compiled parts, both the recorder's: its column stacking (producer/_stack.c) and
log_step's fast path (producer/_hotpath.c).

Everything else is configured in pyproject.toml. The extensions are optional: where no C
compiler is at hand the install goes on without them and the recorder does that work in Python
(same effect, more CPU per step); `rlrec.producer.recorder.ACCELERATED` says which is used.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"rlrec.producer.{name}",
            [f"producer/{name}.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        )
        for name in ("_stack", "_hotpath")
    ]
)
