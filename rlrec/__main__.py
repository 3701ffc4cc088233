"""``python -m rlrec`` == ``rlrec``."""

import sys

from rlrec.cli import main

sys.exit(main())
