"""``python -m modelsize``."""

import sys

from modelsize.cli import main

sys.exit(main())
