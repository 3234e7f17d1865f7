"""``python -m memcompile`` is the ``memcompile`` command."""

import sys

from memcompile.cli import main

sys.exit(main())
