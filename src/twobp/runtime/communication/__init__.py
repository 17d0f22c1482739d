"""Moving tensors between ranks: the step's point-to-point channel and the few collectives."""
