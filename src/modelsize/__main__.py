"""``python -m modelsize``."""

import sys

try:
    from modelsize.cli import main
except KeyboardInterrupt:  # a Ctrl-C before main()'s own funnel is in place
    sys.stderr.write("modelsize: interrupted\n")
    sys.exit(130)

sys.exit(main())
