import sys

from graphshard.tools.cli import main

sys.exit(main())
