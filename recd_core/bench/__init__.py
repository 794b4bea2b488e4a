"""`recd bench`: the headline ratios side by side and the model's quality next to references."""
