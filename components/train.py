"""Component `train`: train the DLRM on one arm's batches; checkpoints, resumable."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("train"))
