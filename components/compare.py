"""Component `compare`: both arms side by side, the chart, and the quality gate (exit 3)."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("compare"))
