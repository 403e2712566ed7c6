"""`python -m bonsai_fetch` = the `bonsai-fetch` console script."""

import sys

from bonsai_fetch.cli import main

sys.exit(main())
