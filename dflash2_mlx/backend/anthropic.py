"""(anthropic adapter: being written.)"""


def add_routes(app, pool):
    """Register this API's routes on app."""
