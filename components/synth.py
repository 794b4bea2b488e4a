"""Component `synth`: synthesize raw logs for the days that have none (the embedded default)."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("synth"))
