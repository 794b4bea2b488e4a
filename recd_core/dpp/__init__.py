"""DPP: samples → preprocessed batches (IKJT for dedup, KJT for the baseline), and the batch format."""
