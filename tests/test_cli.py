"""The command line as a user runs it: real subprocesses, real output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from wsync.cli import COMMANDS


def wsync(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsync", *args], capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_command():
    out = wsync("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout
        sub = wsync(name, "--help")
        assert sub.returncode == 0, sub.stderr
        assert "--" in sub.stdout  # flags are listed with their help


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
def test_train_prints_loss_and_lr_per_step():
    out = wsync("train", "--steps", "2", "--nproc", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 2 and all("loss" in l and "lr" in l for l in lines)


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
        for url, served in s["servers"].items():
            assert served["version"] == str(s["step"])
            assert served["answer"] == s["trainer_answer"]
