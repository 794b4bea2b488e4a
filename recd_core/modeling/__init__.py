"""The model: the DLRM, its optimizer, training, scoring and metrics."""
