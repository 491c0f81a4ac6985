"""``python -m softprior.cli``: the command line (``softprior.cli.main``)."""

import sys

from softprior.cli import main

sys.exit(main())
