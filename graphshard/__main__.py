import sys

from graphshard.cli import main

sys.exit(main())
