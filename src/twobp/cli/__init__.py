"""The ``twobp`` command line."""
