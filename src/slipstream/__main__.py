"""`python -m slipstream`: the `slipstream` command where no entry point is installed (a
source tree on PYTHONPATH, as on the GPU machine)."""

import sys

from .cli import main

sys.exit(main())
