"""``python -m batchwire.monitor ENDPOINT``: the same as the ``pipeline-monitor`` command."""

import sys

from batchwire.monitor.cli import main

sys.exit(main())
