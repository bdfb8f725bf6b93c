"""Fixtures for the third-party client tests: the steered recipe and grammars once, one
SteeredServer per module."""
from __future__ import annotations

import pytest
from thirdparty_support import SteeredServer
from steered_support import recipe_grammars, tools_recipe


@pytest.fixture(scope="session")
def recipe(tmp_path_factory):
    return tools_recipe(tmp_path_factory.mktemp("tools_recipe"))


@pytest.fixture(scope="session")
def grammars(recipe):
    grammars = recipe_grammars(recipe)
    yield grammars
    grammars.close()


@pytest.fixture(scope="module")
def server(recipe, grammars):
    server = SteeredServer(recipe, grammars)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def fresh_requests(server):
    """Each test sees only its own requests in `server.engine.added`."""
    server.engine.added.clear()
