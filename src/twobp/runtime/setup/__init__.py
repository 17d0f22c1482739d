"""Building a pipeline: the plan, schedule="auto", the model check, the replicas."""
