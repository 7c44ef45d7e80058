"""HTTP client for SGLang's weight-update API: one server (:class:`ServerClient`) or many (:class:`ServerGroup`).

A real SGLang server and the project's reference server look the same to the caller. The client reads
the server's SGLang version once (``/server_info`` ``version``, or ``/get_server_info`` on servers older
than 0.5.6, which have no ``/server_info``) and speaks that version's dialect
(:class:`bridge.protocol.ProtocolFeatures`): it uses the info routes the server has, omits fields an old
server does not know, turns ``begin/end_weight_update`` into no-ops where sessions do not exist, never
asks for a cache flush while generations are paused in place (SGLang asserts or fails there), and
refuses up front what the server cannot do (a flattened bucket for a server older than 0.5.6; the
project's shared-memory extension for a server that is not the reference server), so the trainer
learns it before it starts a broadcast.

Keys follow SGLang's ``srt/utils/auth.py``: the control routes (:data:`bridge.protocol.ADMIN_ROUTES`)
carry ``admin_api_key`` when one is given, every other route carries ``api_key``.

Errors are the project's own (:mod:`bridge.errors`): an HTTP error or ``success: false`` raises
``ServerError(server, message, status, route)`` with the server's message; a connection failure raises
``ServerError`` with ``status=None``; an answer that does not come within the call's timeout raises
``SyncTimeout`` naming the server and route; the reference server's refusal of a weight version older
than the one it serves raises ``VersionError``.

Modules: ``connection`` (HTTP, keys, errors), ``server`` (:class:`ServerClient`, one server's dialect),
``updates`` (its weight-update routes), ``group`` (:class:`ServerGroup`, the fan-out) and ``results`` (what an
answer says about the weights it ran on: :func:`~bridge.client.results.generation_versions`, the per-token version
spans); this one re-exports both classes and ``generation_versions``.

Example:
    >>> c = ServerClient("http://127.0.0.1:30000")                      # doctest: +SKIP
    >>> c.features.needs_session                                         # doctest: +SKIP
    True
    >>> group = ServerGroup(["127.0.0.1:30000", "127.0.0.1:30001"])     # doctest: +SKIP
    >>> group.rank_offsets(), group.world_size()                         # doctest: +SKIP
    ([1, 2], 3)
    >>> group.weight_versions()                                          # doctest: +SKIP
    {'http://127.0.0.1:30000': 'default', 'http://127.0.0.1:30001': 'default'}
"""

from __future__ import annotations

from bridge.client.group import ServerGroup
from bridge.client.results import generation_versions
from bridge.client.server import ServerClient

__all__ = ["ServerClient", "ServerGroup", "generation_versions"]
