"""The ``kvguard`` command line."""
