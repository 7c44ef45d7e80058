"""``PublisherConfig`` is nested (run, fleet, timeouts, auth, the transport's and the encoding's options), takes
the flat keywords it always took, refuses another transport's or encoding's option naming its owner, and every
``wsync train`` publishing flag is generated from the field: its help, and the field's default, written once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from bridge import PublisherConfig
from bridge.config import GROUPS, Auth, Fleet, RunIdentity, Timeouts, config_fields
from bridge.encodings.delta import DeltaOptions
from bridge.encodings.fp8 import Fp8Options
from bridge.errors import ConfigError
from bridge.options import NoOptions
from bridge.transports.base import SessionOptions
from bridge.transports.disk import DiskOptions


def test_flat_keywords_land_in_their_groups_and_read_back_flat():
    cfg = PublisherConfig(transport="disk", keep_snapshots=5, servers=["http://a:1/"], http_timeout=7.0, trial="t",
                          api_key="k", min_servers=1)
    assert cfg.fleet == Fleet(servers=["http://a:1"]) and cfg.timeouts == Timeouts(http_timeout=7.0)
    assert cfg.run == RunIdentity(trial="t") and cfg.auth == Auth(api_key="k")
    assert cfg.options == DiskOptions(keep_snapshots=5) and cfg.encoding_options == NoOptions()
    # read flat, as every reader always did
    assert (cfg.servers, cfg.http_timeout, cfg.trial, cfg.api_key, cfg.keep_snapshots) == (
        ["http://a:1"], 7.0, "t", "k", 5)
    with pytest.raises(AttributeError, match="no setting 'pause_mode'"):
        cfg.pause_mode  # noqa: B018 (a broadcast option: the disk transport has none)


def test_groups_given_as_objects_and_checked_on_their_own():
    cfg = PublisherConfig(fleet=Fleet(servers=["x"], min_servers=2), timeouts=Timeouts(group_timeout=9.0),
                          encoding="delta", encoding_options=DeltaOptions(delta_anchor_every=3))
    assert cfg.min_servers == 2 and cfg.group_timeout == 9.0 and cfg.delta_anchor_every == 3
    with pytest.raises(ConfigError, match=r"\['servers'\] given both as keywords and in fleet="):
        PublisherConfig(fleet=Fleet(servers=["x"]), servers=["y"])
    with pytest.raises(ConfigError, match="timeouts= must be a Timeouts, got dict"):
        PublisherConfig(servers=["x"], timeouts={"http_timeout": 1})
    with pytest.raises(ConfigError, match="http_timeout must be a positive number of seconds"):
        Timeouts(http_timeout=0)
    with pytest.raises(ConfigError, match="min_servers must be an integer >= 1"):
        Fleet(min_servers=0)
    with pytest.raises(ConfigError, match="delta_anchor_every must be an integer >= 1"):
        DeltaOptions(delta_anchor_every=0)
    with pytest.raises(ConfigError, match="fp8_skip must be a list"):
        Fp8Options(fp8_skip="layers")
    with pytest.raises(ConfigError, match="options for the delta encoding must be a DeltaOptions"):
        PublisherConfig(servers=["x"], encoding="delta", encoding_options=Fp8Options())


def test_an_option_of_another_encoding_is_refused_naming_its_encoding():
    with pytest.raises(ConfigError, match="delta_anchor_every is an option of the delta and fp8_delta encodings, not "
                                          "of the full encoding \\(the full encoding's options: none\\)"):
        PublisherConfig(servers=["x"], delta_anchor_every=5)
    with pytest.raises(ConfigError, match="fp8_skip is an option of the fp8 and fp8_delta encodings, not of the delta"):
        PublisherConfig(servers=["x"], encoding="delta", fp8_skip=["layers"])
    with pytest.raises(ConfigError, match="keep_snapshots is an option of the disk transport, not of broadcast"):
        PublisherConfig(servers=["x"], encoding="delta", keep_snapshots=5)
    assert PublisherConfig(servers=["x"], encoding="fp8", fp8_skip=["layers"]).encoding_options.fp8_skip == ("layers",)
    assert "delta_anchor_every" in PublisherConfig.keywords("broadcast")
    assert "delta_anchor_every" not in PublisherConfig.keywords("broadcast", "full")


def test_the_session_options_are_read_typed_not_probed():
    assert isinstance(PublisherConfig(servers=["x"], writer_lock="memory://").session_options, SessionOptions)
    assert PublisherConfig(servers=["x"], writer_lock="memory://").session_options.writer_lock == "memory://"
    assert PublisherConfig(transport="disk").session_options is None
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "bridge"
    probes = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if 'getattr(cfg, "' in line or 'getattr(self.config, "' in line or 'getattr(config, "' in line]
    assert not probes, probes


def test_each_default_is_the_field_s_and_the_signature_shows_it():
    params = inspect.signature(PublisherConfig).parameters
    for group in GROUPS.values():
        for f in dataclasses.fields(group):
            assert params[f.name].default == f.default, f.name
    assert str(params["bucket_mb"].default) == "512 with CUDA, else 32"
    assert set(GROUPS) | {"options", "encoding_options"} <= set(params)


def _train_parser() -> argparse.ArgumentParser:
    from wsync.train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_every_setting_is_a_generated_flag_with_its_help_and_the_field_s_default():
    actions = {a.dest: a for a in _train_parser()._actions}
    fields = config_fields()
    assert {"transport", "servers", "http_timeout", "api_key", "keep_snapshots", "delta_anchor_every",
            "fp8_skip", "pause_mode", "experiment", "new_run"} <= {o.name for o in fields}
    for o in fields:
        a = actions[o.name]
        assert len(o.help) > 10 and a.help.startswith(f"{'/'.join(o.owners) + ' ' + o.kind + ': ' if o.kind else ''}"
                                                      f"{o.help[:20].replace('%', '%%')}"), o.name
        if o.name == "transport":
            assert a.default == "none" and "(default: none, train without publishing)" in a.help
        else:
            assert a.default is None, o.name  # a flag left out keeps the field's default ...
            if o.default_text:  # ... which --help shows
                assert f"(default: {o.default_text})" in a.help or "(default: " in o.help, o.name
    # the values the hand-written flags used to repeat are the fields' own now
    by = {o.name: o for o in fields}
    assert by["delta_max_fraction"].default == DeltaOptions().delta_max_fraction
    assert by["trial"].default == RunIdentity().trial and by["bucket_mb"].default_text == "512 with CUDA, else 32"


def test_the_flags_build_the_config_and_the_ranks_command_line_says_the_same():
    from wsync.flags import config_keywords
    from wsync.train import _argv_of, publisher_config

    p = _train_parser()
    args = p.parse_args(["--publish", "disk", "--server", "http://a:1", "--server", "http://b:2", "--keep-snapshots",
                         "2", "--no-wait-loaded", "--http-timeout", "9", "--trial", "t", "--new-run"])
    assert config_keywords(args) == dict(transport="disk", servers=["http://a:1", "http://b:2"], keep_snapshots=2,
                                         wait_loaded=False, http_timeout=9.0, trial="t", new_run=True)
    cfg = publisher_config(args)
    assert (cfg.servers, cfg.keep_snapshots, cfg.wait_loaded, cfg.http_timeout, cfg.experiment) == (
        ["http://a:1", "http://b:2"], 2, False, 9.0, RunIdentity().experiment)
    assert vars(p.parse_args(_argv_of(args))) == vars(args)
    with pytest.raises(ConfigError, match="keep_snapshots is an option of the disk transport, not of broadcast"):
        publisher_config(p.parse_args(["--publish", "broadcast", "--server", "http://a:1", "--keep-snapshots", "2"]))
    assert config_keywords(p.parse_args([])) == {"transport": "none"}
