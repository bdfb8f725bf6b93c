from tests.engine.conftest import _reuse_loaded_weights, default_model  # noqa: F401
