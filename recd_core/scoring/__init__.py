"""Scoring requests (MLflow's scoring protocol): sample rows typed and checked as ingest
checks events (request.py), and ranking requests, one user and its candidates, built straight
into the model's batch (ranking.py). Below mlops: the served pyfunc and `recd serve` both
speak them."""
