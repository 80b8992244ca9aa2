import sys

from raysync.cli import main

sys.exit(main())
