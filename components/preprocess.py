"""Component `preprocess`: DPP: transform once per unique feature value, write IKJT (dedup) or KJT (baseline) batches."""

import sys

from components._entry import main

if __name__ == "__main__":
    sys.exit(main("preprocess"))
