"""Component `start`: open the pipeline's MLflow run (the parent of every stage's run)."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("start"))
