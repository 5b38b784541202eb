"""`python -m batchwire.server` = `pipeline-server`."""

import sys

from batchwire.server.cli import main

sys.exit(main())
