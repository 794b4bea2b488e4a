"""Component `register`: log the model to MLflow, register it as challenger, promote to champion by NE."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("register"))
