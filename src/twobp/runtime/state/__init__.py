"""What a pipeline holds as a model: parameters, gradient norm, checkpoints."""
