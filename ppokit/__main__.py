"""``python -m ppokit`` runs the command line."""

import sys

from ppokit.cli import main

sys.exit(main())
