"""``python -m marsproxy.cli``: the ``marsproxy`` command (subprocesses in tests and benchmarks)."""

import sys

from marsproxy.cli import main

sys.exit(main())
