"""`python -m peftx`: the `peftx` command."""

import sys

from .cli import main

sys.exit(main())
