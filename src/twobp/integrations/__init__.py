"""Models from other libraries as twobp pipeline blocks (each behind an optional dependency)."""
