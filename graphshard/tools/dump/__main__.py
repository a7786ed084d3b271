import sys

from graphshard.tools.dump.cli import main

sys.exit(main())
