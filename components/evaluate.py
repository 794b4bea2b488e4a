"""Component `evaluate`: NE, AUC, log loss, calibration of the trained model on the next day."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("evaluate"))
