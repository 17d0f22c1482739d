"""twobp: pipeline-parallel training with 2-stage backpropagation (2BP)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
