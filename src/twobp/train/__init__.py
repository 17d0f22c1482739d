"""The training job behind ``twobp train``: data, the per-rank loop and the report."""
