"""``python -m wsync ...`` is the same as the ``wsync`` command."""

import sys

from wsync.cli import main

sys.exit(main())
