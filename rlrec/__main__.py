"""``python -m rlrec`` == ``rlrec``."""

import sys

from rlrec.cli import run

sys.exit(run())
