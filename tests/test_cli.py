"""The command line as a user runs it: real subprocesses, real output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from wsync.cli import COMMANDS


def wsync(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsync", *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_command():
    from bridge.name_resolve import DEFAULT_URL
    from bridge.transports.disk import default_snapshot_root
    from wsync.cli import build_parser

    out = wsync("--help")  # the entry point itself; each command's help is the parser `wsync NAME --help` prints
    assert out.returncode == 0
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in COMMANDS:
        assert name in out.stdout
        help_text = commands[name].format_help()
        assert help_text.startswith(f"usage: wsync {name} ")
        assert "--" in help_text  # flags are listed with their help
        if name == "train":  # where the disk transport's state lives
            text = " ".join(help_text.split())
            root = os.path.join(default_snapshot_root(), "<experiment>", "<trial>")
            assert f"(default: {DEFAULT_URL})" in text and f"(default: {root})" in text


def test_make_model_writes_a_loadable_hf_directory(tmp_path):
    out = wsync("make-model", str(tmp_path / "m"), "--preset", "tiny")
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert sum(p.numel() for p in model.parameters()) > 100_000
    assert tok.decode(tok("héllo")["input_ids"]) == "héllo"


def test_bad_flags_are_refused_with_a_message():
    out = wsync("demo", "--steps", "0")
    assert out.returncode == 2 and "--steps" in out.stderr
    out = wsync("train", "--schedule", "sideways")
    assert out.returncode == 2 and "sideways" in out.stderr


@pytest.mark.slow
def test_demo_main_job_end_to_end(tmp_path):
    report = tmp_path / "out.json"
    out = wsync("demo", "--steps", "2", "--transport", "both", "--json", str(report), "--workdir", str(tmp_path / "w"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] is True
    assert [(s["step"], s["transport"]) for s in data["syncs"]] == [
        (1, "broadcast"), (1, "disk"), (2, "broadcast"), (2, "disk")]
    for s in data["syncs"]:
        for served in s["servers"].values():
            assert served["version"] == str(s["step"])
            assert served["answer"] == s["trainer_answer"]
            # the versions its tokens ran on, as the server reports them (spans from SGLang 0.5.20's dialect)
            assert [sp["version"] for sp in served["weight_versions"]] == [str(s["step"])]
            assert served["weight_versions"][0]["end"] == served["completion_tokens"] > 0
    assert "versions ran on" in out.stdout


def last_line(out: subprocess.CompletedProcess) -> str:
    return (out.stdout + out.stderr).strip().splitlines()[-1]


def test_flags_are_checked_before_any_rank_starts():
    for value in ("0", "-1"):
        out = wsync("train", "--publish", "disk", "--bucket-mb", value, timeout=60)
        assert out.returncode == 2
        assert last_line(out) == f"wsync train: error: --bucket-mb must be a positive number of MiB, got {value}"
        assert "engine ready" not in out.stderr  # refused before the ranks loaded a model
    out = wsync("demo", "--bucket-mb", "0", timeout=60)
    assert out.returncode == 2 and "--bucket-mb must be a positive" in last_line(out)


def test_debug_brings_tracebacks_back():
    out = wsync("train", "--publish", "disk", "--bucket-mb", "0", "--debug", timeout=60)
    assert out.returncode == 2 and "Traceback" in out.stderr
    assert last_line(out).startswith("wsync train: error: --bucket-mb")


def test_serve_on_a_taken_port_says_so_before_loading(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = wsync("serve", "--preset", "tiny", "--port", str(port), timeout=60)
    assert out.returncode == 2
    assert last_line(out).startswith(f"wsync serve: error: cannot listen on 127.0.0.1:{port}")
    assert "--port" in last_line(out) and "loaded" not in out.stderr


def test_serve_a_model_directory_without_a_tokenizer_says_so(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, model)
    for f in os.listdir(model):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.remove(model / f)
    out = wsync("serve", "--model", str(model), "--port", "0", timeout=120)
    assert out.returncode == 2, out.stderr
    assert last_line(out).startswith(f"wsync serve: error: {model} has no tokenizer (tokenizer.json or "
                                     "tokenizer_config.json)"), out.stderr
    assert "sentencepiece" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_watch_fails_with_one_line_when_etcd_is_unreachable():
    from bridge.process_group import find_free_port

    url = f"etcd://127.0.0.1:{find_free_port()}?retry_deadline=1"
    out = wsync("watch", "--name-resolve", url, "--server", "http://127.0.0.1:9", timeout=60)
    assert out.returncode == 1, out.stderr
    assert last_line(out).startswith("wsync watch: error: the watcher stopped: etcd")
    assert "is etcd running" in last_line(out)


def test_watch_once_says_why_nothing_was_loaded(tmp_path):
    out = wsync("watch", "--once", "--name-resolve", f"file://{tmp_path}/nr", "--server", "http://127.0.0.1:9",
                timeout=60)
    assert out.returncode == 1
    assert last_line(out).startswith("wsync watch: error: no version announced yet for default/trial0")


@pytest.mark.slow
def test_rerunning_disk_training_continues_the_version_numbers(tmp_path):
    disk = ["--nproc", "1", "--publish", "disk", "--name-resolve", f"file://{tmp_path}/nr",
            "--snapshot-root", str(tmp_path / "snap")]
    first = wsync("train", "--steps", "2", *disk)
    assert first.returncode == 0, first.stderr[-2000:]
    steps = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("loss" in s and "lr" in s and "published v" in s for s in steps)
    again = wsync("train", "--steps", "1", *disk)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "publishing versions 3..3" in again.stdout
    assert "published v3" in again.stdout.strip().splitlines()[-1]
    refused = wsync("train", "--steps", "1", "--start-version", "1", *disk, timeout=60)
    assert refused.returncode == 2
    assert "pass --start-version 4" in last_line(refused) and last_line(refused).startswith("wsync train: error:")


def test_an_unreachable_server_is_named_before_any_rank_starts():
    out = wsync("train", "--publish", "broadcast", "--server", "http://127.0.0.1:9", timeout=60)
    assert out.returncode == 2
    assert last_line(out) == ("wsync train: error: cannot reach --server http://127.0.0.1:9: is a server running "
                              "there (`wsync serve --port N`) and is the URL right?")


@pytest.mark.slow
def test_a_trainer_rank_error_is_one_line_not_a_torchrun_report(tmp_path):
    # Every rank fails the same way in its first publish: the snapshot folder cannot be created.
    out = wsync("train", "--steps", "1", "--publish", "disk", "--snapshot-root", "/proc/no-such-folder",
                "--name-resolve", f"file://{tmp_path}/nr")
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "ChildFailedError" not in text
    assert [line for line in text.splitlines() if "error:" in line] == [last_line(out)]
    assert last_line(out).startswith("wsync train: error: disk sync of version 1 failed")
    assert "/proc/no-such-folder" in last_line(out)


@pytest.mark.slow
def test_train_publishes_to_a_server_started_with_keys(tmp_path):
    from inference_adapter.launcher import launch_server

    server = launch_server(preset="tiny", extra_args=["--api-key", "user-key", "--admin-api-key", "admin-key"],
                           api_key="user-key", log_path=str(tmp_path / "server.log"))
    try:
        broadcast = ["train", "--nproc", "1", "--steps", "1", "--publish", "broadcast", "--server", server.url]
        keys = ["--api-key", "user-key", "--admin-api-key", "admin-key"]
        out = wsync(*broadcast, *keys)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "published v1" in out.stdout
        # A restarted trainer of the same run cannot take the server back to version 1 ...
        refused = wsync(*broadcast, *keys, "--start-version", "1", timeout=60)
        assert refused.returncode == 2 and "--new-run" in last_line(refused), refused.stdout + refused.stderr
        # ... unless it says it starts a new run (the server is strict: no --allow-version-rollback).
        fresh = wsync(*broadcast, *keys, "--new-run")
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        assert "published v1" in fresh.stdout and server.client.model_info()["weight_version"] == "1"
    finally:
        server.stop()
