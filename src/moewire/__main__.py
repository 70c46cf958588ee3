"""``python -m moewire``: the ``moewire`` command (:mod:`moewire.cli`)."""

import sys

from moewire.cli import main

if __name__ == "__main__":
    sys.exit(main())
