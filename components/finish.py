"""Component `finish`: close the pipeline's MLflow run with every stage's figures."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("finish"))
