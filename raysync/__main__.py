import sys

from raysync.tools.cli import main

sys.exit(main())
