import pytest

from .openai_standin import StandInOptions, StandInServer


@pytest.fixture
def standin():
    """Start stand-in OpenAI-compatible servers with given options; all are stopped after the test."""
    servers = []

    def start(**options) -> StandInServer:
        server = StandInServer(StandInOptions(**options)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
