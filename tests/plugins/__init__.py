"""Transports registered from outside the project, as a user's own would be: every module here is named in
``WSYNC_PLUGINS`` by ``tests/conftest.py``, so each one is in the registry of every test and subprocess."""
