"""Tools: the ``raysync`` command (cli.py: doctor, bench, demo), and the small models and layouts they and the
tests use (models.py)."""
