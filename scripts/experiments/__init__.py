"""One-off studies behind the project's design choices (see ../README.md)."""
