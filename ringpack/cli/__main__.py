"""``python -m ringpack.cli``: the same command line as ``ringpack``."""

import sys

from ringpack.cli import main

sys.exit(main())
