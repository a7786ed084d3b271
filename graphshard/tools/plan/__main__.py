"""`python -m graphshard.tools.plan` (the same as `graphshard plan`)."""

import sys

from graphshard.tools.plan import main

sys.exit(main())
