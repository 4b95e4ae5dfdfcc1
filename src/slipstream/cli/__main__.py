"""`python -m slipstream.cli`: the same command as `python -m slipstream`."""

import sys

from . import main

sys.exit(main())
