"""``python -m verispec.cli``: the ``verispec`` command line (as ``python -m verispec``)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
