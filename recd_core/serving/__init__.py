"""Serving the champion: `recd serve` (app.py) over the scoring requests of
recd_core.scoring (sample rows and ranking requests, checked like ingest's events)."""
