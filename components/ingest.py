"""Component `ingest`: validate raw logs into events/ds=D; bad rows to quarantine/ds=D with a reason."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("ingest"))
