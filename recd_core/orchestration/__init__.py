"""The pipeline declared once (graph), what each stage does (stages) and the local runner."""
