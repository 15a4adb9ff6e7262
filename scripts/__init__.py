"""Scripts beside the package: the recipe that made the shipped drafters (``recipe/``) and one-off
studies (``experiments/``).  Importable as modules for the tests; each also runs as
``python scripts/<folder>/<name>.py``."""
