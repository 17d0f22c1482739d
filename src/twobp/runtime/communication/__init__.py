"""Moving tensors between ranks: the point-to-point channel, the collectives, the agreement."""
