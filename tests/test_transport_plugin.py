"""A transport is one new file: the toy ``file`` transport of ``tests/plugins`` registers itself when
imported and is then a transport like the project's own, everywhere transports are listed.

What it must show (issue 23): it publishes end to end through the same driver; it is in ``wsync train
--help`` and in the fault matrix (``tests/test_faults.py`` reads the registry); an unknown name is a
ConfigError listing the transports; the driver names no transport and probes no source.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from bridge import ConfigError, PublisherConfig, WeightPublisher
from bridge.transports import transport_class, transport_names

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILTIN = ("broadcast", "colocated", "disk")


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory.many([dict(model=tiny_model_dir)])[0]


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _served_exactly(server, model) -> bool:
    from bridge.digest import tensor_checksum
    from bridge.sources import ModuleSource

    want = {spec.name: tensor_checksum(t.to(torch.bfloat16)) for spec, t in ModuleSource(model).iter_full_tensors()}
    return server.client.weights_checksum(list(want))["checksums"] == want


def test_the_toy_transport_is_registered_after_the_projects_own():
    assert transport_names()[:3] == list(BUILTIN) and "file" in transport_names()
    assert transport_class("file").__module__ == "tests.plugins.file_transport"


def test_it_publishes_end_to_end_through_the_same_driver(server, model, tmp_path):
    with WeightPublisher(PublisherConfig(transport="file", servers=[server.url], file_dir=str(tmp_path),
                                         bucket_mb=0.5, progress=False)) as pub:
        result = pub.publish(model, version=1)
        assert (result.transport, result.servers) == ("file", {server.url: "ok"}) and result.buckets >= 2
        assert server.client.model_info()["weight_version"] == "1" and _served_exactly(server, model)
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)
        pub.publish(model, version=2)
        assert server.client.model_info()["weight_version"] == "2" and _served_exactly(server, model)
    assert os.listdir(tmp_path) == []  # every bucket file was removed once the server read it


def test_its_options_are_checked_and_read_back(tmp_path):
    from tests.plugins.file_transport import FileOptions

    cfg = PublisherConfig(transport="file", servers=["http://127.0.0.1:1"], options=FileOptions(file_dir=str(tmp_path)))
    assert cfg.file_dir == str(tmp_path) and cfg.pause_mode == "auto" and cfg.writer_lease == 10.0
    with pytest.raises(ConfigError, match="file_dir"):
        PublisherConfig(transport="file", servers=["http://127.0.0.1:1"], file_dir=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not local"):
        PublisherConfig(transport="file", servers=["http://10.1.2.3:30000"])


def test_a_source_without_what_it_needs_is_refused_before_anything_moves(server, model):
    class Bare:  # param_specs and iter_full_tensors only: no local_digest, which the toy declares it needs
        def __init__(self, module):
            from bridge.sources import ModuleSource

            self.inner = ModuleSource(module)

        def param_specs(self):
            return self.inner.param_specs()

        def iter_full_tensors(self, specs=None):
            return self.inner.iter_full_tensors(specs)

    before = server.client.model_info()["weight_version"]
    with WeightPublisher(PublisherConfig(transport="file", servers=[server.url], progress=False)) as pub:
        with pytest.raises(ConfigError, match="local_digest"):
            pub.publish(Bare(model), version=99)
    assert server.client.model_info()["weight_version"] == before


def test_an_unknown_transport_names_the_known_ones():
    with pytest.raises(ConfigError) as e:
        PublisherConfig(transport="broadcastt", servers=["http://127.0.0.1:1"])
    assert all(repr(name) in str(e.value) for name in transport_names())


def test_wsync_train_lists_it_with_its_options():
    out = subprocess.run([sys.executable, "-m", "wsync.cli", "train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout
    assert "{none," + ",".join(transport_names()) + "}" in out.replace(" ", "").replace("\n", "")
    assert "--file-dir" in out and "--disk-writers" in out and "--master-port" in out


def test_a_plugin_that_cannot_be_imported_is_a_config_error_naming_it():
    code = "from bridge import PublisherConfig\nPublisherConfig(servers=['http://127.0.0.1:1'])"
    env = {**os.environ, "WSYNC_PLUGINS": "no_such_module_here"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode != 0 and "ConfigError" in proc.stderr and "no_such_module_here" in proc.stderr


def test_the_driver_names_no_transport_and_probes_no_source():
    text = (ROOT / "bridge" / "publisher" / "core.py").read_text()
    assert "inspect.signature" not in text and "getattr(source" not in text
    for name in BUILTIN:
        assert not re.search(rf"\b{name}\b", text, re.I), f"bridge/publisher/core.py names the {name} transport"
    # Nor does it branch on a transport's kind: every transport-specific step goes through its Sink.
    tree = ast.parse(text)
    compared = {c.value for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for c in node.comparators if isinstance(c, ast.Constant)}
    assert not compared & set(transport_names())
