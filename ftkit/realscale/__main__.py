"""`python -m ftkit.realscale`: the command (`ftkit.realscale.command`)."""

import sys

from ftkit.realscale.command import main

if __name__ == "__main__":
    sys.exit(main())
