"""``python -m modelsize``."""

import sys

try:
    from modelsize.cli import main

    code = main()
except KeyboardInterrupt:  # a Ctrl-C before main()'s own funnel is in place
    sys.stderr.write("modelsize: interrupted\n")
    code = 130
sys.exit(code)
