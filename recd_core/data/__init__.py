"""The data layer: raw logs (synthetic or real) → validated events → training samples."""
