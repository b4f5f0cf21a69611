"""The ``meshopt`` command."""
