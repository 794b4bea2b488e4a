"""Container entrypoints, one per stage: `python -m components.<stage> --warehouse W --ds D ...`.
They call `recd_core.orchestration.stages.run_stage` and nothing else."""
