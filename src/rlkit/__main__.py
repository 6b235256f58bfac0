"""``python -m rlkit`` is the ``rlkit`` command."""

import sys

from rlkit.cli import main

sys.exit(main())
