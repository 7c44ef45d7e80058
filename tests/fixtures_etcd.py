"""A real etcd server for the tests (Debian package ``etcd-server``; ``scripts/test.sh`` installs it).

``etcd_server`` (session scope) starts ``etcd`` on free loopback ports with a temporary data directory
and yields a :class:`bridge.name_resolve.local_etcd.LocalEtcd` with ``.url`` (``etcd://127.0.0.1:P``), ``.stop()``,
``.start()`` and ``.restart()`` (same ports, same data: a real etcd restart). Skipped, with the install
hint, where no etcd binary exists.
"""

from __future__ import annotations

import shutil

import pytest

from bridge.name_resolve.local_etcd import INSTALL_HINT, LocalEtcd


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip(INSTALL_HINT)
    server = LocalEtcd(binary, str(tmp_path_factory.mktemp("etcd")), name="t")
    server.start()
    yield server
    server.close()
