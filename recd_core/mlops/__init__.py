"""The record around the model: MLflow runs, the registry and champion/challenger, the arms' comparison."""
