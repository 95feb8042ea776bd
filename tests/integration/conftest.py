"""Integration tests: a real nats-server per module (``nats_server``, ``nc`` in tests/conftest.py).

Shared helpers live in ``pipeline_kit.py`` beside the tests.
"""
