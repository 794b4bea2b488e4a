"""Finding duplicates: unique rows, runs and sessions; jagged tensors and the IKJT."""
