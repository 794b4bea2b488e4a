"""Component `generate`: write session-clustered and shuffled samples for the training day(s), clustered for the evaluation day."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("generate"))
