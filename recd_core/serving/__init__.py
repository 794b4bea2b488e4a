"""Serving the champion: `recd serve` (app.py) over requests parsed and checked like ingest's
events (request.py)."""
