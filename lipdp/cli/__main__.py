"""``python -m lipdp.cli``: the ``lipdp`` command."""

import sys

from lipdp.cli import main

sys.exit(main())
