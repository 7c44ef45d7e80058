"""Per-rank bodies shared by the end-to-end sync tests (importable, so spawned ranks can run them)."""

from __future__ import annotations


def engine(preset: str = "tiny"):
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    e = FSDPEngine(EngineConfig(preset=preset, optimizer=OptimizerConfig(lr=3e-3)))
    e.initialize()
    return e


def check_served(engine, urls: list[str], version: int) -> dict:
    """Rank 0: compare every served tensor, the version and a greedy answer with the trainer's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective
    if engine.rank != 0:
        return {}
    want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in full.items()}
    local = AutoModelForCausalLM.from_config(engine.model_config, dtype=torch.bfloat16).eval()
    local.load_state_dict({n: t.to(torch.bfloat16) for n, t in full.items()}, strict=False)
    local.tie_weights()
    prompt = [1] + [b + 3 for b in b"rev hello="]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = local.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, len(prompt):].tolist()
    report = {}
    for url in urls:
        c = ServerClient(url)
        got = c.weights_checksum(list(want))
        out = c.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
        report[url] = dict(
            tensors_equal=got["checksums"] == want,
            version=c.model_info()["weight_version"],
            generate_version=out["meta_info"]["weight_version"],
            answer_equal=out["output_ids"] == expected[: len(out["output_ids"])] and len(out["output_ids"]) > 0,
        )
    return report


class Sabotage:
    """Wraps a WeightSource; on rank 0, after ``after`` tensors of the second publish, runs ``act``."""

    def __init__(self, engine, after: int, act):
        self.engine, self.after, self.act, self.calls = engine, after, act, 0

    def param_specs(self):
        return self.engine.param_specs()

    def iter_full_tensors(self, specs=None):
        for item in self.engine.iter_full_tensors(specs):
            self.calls += 1
            if self.engine.rank == 0 and self.calls == self.after:
                self.act()
            yield item


def own_checksums(engine) -> dict | None:
    """The trainer's own weights as the servers serve them, one checksum per tensor (collective; rank 0
    gets them, the other ranks None): what a server must hold after a publish, or still hold after a
    failed one."""
    import torch

    from bridge.digest import tensor_checksum

    full = {s.name: t for s, t in engine.iter_full_tensors()}
    return {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in full.items()} if engine.rank == 0 else None


def train_step(engine, seed: int) -> None:
    """One training step, so that the next version's weights differ from the last one's."""
    from wsync.tasks import make_batch

    engine.train_batch(make_batch(engine.tokenizer, 8, seed=seed * 2 + engine.rank))


# The publishers' default writer_lease (bridge/transports/base.py), renewed every third of it while a sync runs.
WRITER_LEASE_S = 10.0
# How long serving_now's generation probe waits. A server a failed sync resumed answers a 1-token generation
# in milliseconds; one left paused holds it until something lifts the pause: for SGLang's own code nothing but
# a publisher, for the reference server its watchdog once the writer lease ran out, at the earliest two thirds
# of the lease (6.7 s) after publish() raised. So an answer within half the lease was not released by the
# server's own safety net, and a loaded machine has seconds to produce one token. That the pause was lifted
# when publish() raised is read from the reference server's state (``paused_at_once``), not timed.
PROBE_S = WRITER_LEASE_S / 2


def _harness_paused(url: str) -> bool | None:
    """Whether SGLang's own scheduler in the test harness is paused (tests/sglang_harness), None elsewhere."""
    import requests

    r = requests.get(url + "/wsync_harness/scheduler", timeout=10)
    return r.json()["paused"] if r.status_code == 200 else None


def serving_now(url: str, lease_wait: float = 0.0) -> dict:
    """A server right now: how long a 1-token generation takes (None: no answer within PROBE_S, the server
    holds it paused), its version, that a new update session can be opened (refused while one is left
    open), whether it was paused when this was called (``paused_at_once``, read before anything waits: the
    reference server's state, or SGLang's own scheduler in the harness, whose held generation is then not
    timed out), and for the reference server its pause and session state, the writer holding it (a failed sync
    releases it; a dead trainer's runs out: ``lease_wait`` seconds are waited for that) and the checksum of
    every served tensor (SGLang's own code has no such route; its weights are torn by a failed sync by
    design, so it is then held paused until a publish repairs it)."""
    import time

    from bridge.client import ServerClient
    from bridge.errors import BridgeError

    c = ServerClient(url, timeout=10)
    reference = c.can.extensions
    paused_at_once = c.server_info()["internal_states"][0]["paused"] if reference else _harness_paused(url)
    generate_s = generate_version = None
    if reference or not paused_at_once:  # SGLang's scheduler says it holds generations: no need to time one out
        t = time.monotonic()
        try:
            answer = ServerClient(url, timeout=PROBE_S).generate(input_ids=[1, 4, 5],
                                                                 sampling_params={"temperature": 0, "max_new_tokens": 1})
            generate_s, generate_version = time.monotonic() - t, answer["meta_info"]["weight_version"]
        except BridgeError:
            pass
    out = dict(generate_s=generate_s, generate_version=generate_version, paused_at_once=paused_at_once,
               version=c.model_info()["weight_version"], paused=None, session_open=None, checksums=None,
               writer_lease=None)
    if reference:
        deadline = time.monotonic() + lease_wait
        while (state := c.server_info()["internal_states"][0])["writer_lease"] and time.monotonic() < deadline:
            time.sleep(0.1)
        out.update(paused=state["paused"], session_open=state["update_session_open"],
                   checksums=c.weights_checksum()["checksums"], writer_lease=state["writer_lease"])
        if state["writer_lease"] is not None:
            return out  # a writer holds it: the probe below would be refused (assert_left_on says so)
        c.begin_weight_update()
        c.abort_weight_update()
    elif c.features.needs_session:
        c.begin_weight_update()
        c.end_weight_update()
    return out


def publish_then_train(pub, engine, version: int) -> tuple[dict | None, dict | None]:
    """Publish ``version``, then train one step: the trainer's own weights of ``version`` and the new ones
    (rank 0; None elsewhere), so a fault test can tell "still the old weights" from "the new ones"."""
    pub.publish(engine, version=version)
    before = own_checksums(engine)
    train_step(engine, version)
    return before, own_checksums(engine)


def rank0_dies_mid_sync(urls: list[str], out: str, version: int, **config):
    """Every rank: publish ``version``, train, then rank 0 dies in the middle of publishing ``version + 1``
    (it leaves its old and new weights in the file ``out`` first); the other ranks return what they
    raised and how long it took."""
    import json
    import os
    import time

    from bridge import PublisherConfig, WeightPublisher

    e = engine()
    pub = WeightPublisher(PublisherConfig(servers=urls, bucket_mb=0.05, progress=False, **config))
    before, after = publish_then_train(pub, e, version)
    if e.rank == 0:
        with open(out, "w") as f:
            json.dump(dict(before=before, after=after), f)
    t = time.monotonic()
    try:
        pub.publish(Sabotage(e, after=len(e.param_specs()) // 2, act=lambda: os._exit(3)), version=version + 1)
        return ("ok", "", 0.0)
    except Exception as exc:  # the test records whatever comes
        return (type(exc).__name__, str(exc), time.monotonic() - t)


def holds(checksums: dict, want: dict | None) -> bool:
    """True when every tensor the server serves under a name of ``want`` has ``want``'s checksum."""
    shared = [n for n in want or {} if n in checksums]
    return bool(shared) and all(checksums[n] == want[n] for n in shared)


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Make glibc map every allocation of ``nbytes`` or more on its own and unmap it when freed, as the
    bench does (``MALLOC_MMAP_THRESHOLD_``), so the RSS high-water mark shows what the pipeline holds.

    By default glibc raises its mmap threshold to the size of the last mapping freed (up to 32 MiB): the
    gather pieces (a few MiB) then come from per-thread heaps, which keep them after they are freed, and
    how much they keep depends on how the main thread, gloo's and the broadcast thread interleave: on a
    busy machine that was 0.4 bucket more (2.70 x bucket instead of 1.4-2.3 x)."""
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(M_MMAP_THRESHOLD, nbytes)


def check_served_any(engine, urls: list[str], version: int) -> dict:
    """:func:`check_served` for the reference server; for SGLang's own code (the ``sglang_code`` tier),
    every served tensor through the harness's checksum route, in SGLang's stacked layout, and the version
    (collective; rank 0 gets the report)."""
    import requests
    import torch

    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    if ServerClient(urls[0]).can.extensions:
        return check_served(engine, urls, version)
    from tests.sglang_harness.serve import sglang_layout

    full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective
    if engine.rank != 0:
        return {}
    want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in sglang_layout(full).items()}
    report = {}
    for url in urls:
        got = requests.get(url + "/wsync_harness/weights", timeout=30).json()["checksums"]
        # Every tensor, both ways: none is left out legitimately. A tied head is neither sent (the trainer's
        # param_specs leave it out) nor served apart (SGLang's named_parameters yield it once, as the
        # embedding), so the trainer's tensors in SGLang's layout are exactly the served ones (16 of 16 on
        # 0.5.23, 0.5.6 and 0.4.9; test_sglang_code's "all but one, lm_head is tied" spares nothing). A served
        # tensor the trainer did not compare (it stopped sending one, say) would otherwise stay stale unseen.
        unmatched = sorted(set(want) ^ set(got))
        report[url] = dict(tensors_equal=not unmatched and all(got[n] == want[n] for n in want), unmatched=unmatched,
                           version=ServerClient(url).model_info()["weight_version"])
    return report


def matrix_transports() -> list[tuple[str, int]]:
    """Every registered transport (the project's and the test plugins', ``tests/plugins``), each with the
    first version it publishes in a matrix: 10, 20, ... so that versions only go up on a shared server."""
    from bridge.transports import transport_names

    return [(name, 10 * (i + 1)) for i, name in enumerate(transport_names())]


def announces(transport: str) -> bool:
    """True for a transport that needs no server (disk): the matrices check what it announced instead."""
    from bridge.transports import transport_class

    return not transport_class(transport).needs_servers


def matrix_publisher(transport: str, urls: list[str], nr_url: str, root: str):
    """The publisher the fault and interrupt matrices use: small buckets (many steps to fail in), 20 s
    bounds; a transport that announces waits for no server."""
    from bridge import PublisherConfig, WeightPublisher

    disk = {k: v for k, v in dict(name_resolve=nr_url, snapshot_root=root).items()
            if k in PublisherConfig.keywords(transport)}  # only a transport that announces takes them
    return WeightPublisher(PublisherConfig(
        transport=transport, servers=[] if announces(transport) else urls,
        bucket_mb=0.05, group_timeout=20, http_timeout=20, progress=False, **disk,
    ))


def run_into_sglang(body, model_dir: str, tmp_path, transports: list[tuple[str, int]]):
    """Run a matrix body (``body(urls, nr_url, root, transports)``) on 2 ranks against SGLang 0.5.23's
    own code; returns (rank 0's runs, rank 1's runs, the server's URL). Skips where it is not installed."""
    import pytest

    from tests.dist_utils import run_ranks
    from tests.sglang_harness import installed, launch

    if not installed("0.5.23"):
        pytest.skip("SGLang 0.5.23 is not installed (bash scripts/install_sglang.sh)")
    with launch("0.5.23", model_dir) as srv:
        args = ([srv.url], f"file://{tmp_path / 'nr'}", str(tmp_path / "snap"), transports)
        runs0, runs1 = run_ranks(body, 2, args=args, timeout=300)
        assert srv.alive()
    return runs0, runs1, srv.url


def assert_left_on(now: dict, version: int, was: dict, own_before: dict, own_after: dict, where: str,
                   torn: bool = False) -> None:
    """A server after a failed sync (``now``, from :func:`serving_now`): still labelled ``version``,
    answering at once; a reference server also unpaused, with no session, serving exactly what it served
    before (``was``), which is the trainer's ``own_before`` and not its ``own_after``. SGLang's own code
    stages nothing, so its weights carry no such promise (``checksums`` is None there): once a failed
    sync sent it a bucket (``torn``), it is held paused and answers nothing until a publish repairs it."""
    assert now["version"] == str(version), f"{where}: {now['version']}"
    if torn:
        assert now["generate_s"] is None, f"{where}: a server with torn weights answered a generation"
        return
    assert_resumed(now, where)
    assert now["generate_version"] == str(version), f"{where}: answered from {now['generate_version']}"
    if now["checksums"] is None:
        return
    assert now["paused"] is False and now["session_open"] is False, f"{where}: {now}"
    assert now["writer_lease"] is None, f"{where}: the failed sync did not let go of the server: {now['writer_lease']}"
    assert now["checksums"] == was["checksums"], f"{where}: the served weights changed"
    assert holds(now["checksums"], own_before), f"{where}: not the trainer's v{version}"
    assert not holds(now["checksums"], own_after), f"{where}: the new weights are served"


def assert_resumed(now: dict, where: str) -> None:
    """``now`` (:func:`serving_now`, right after publish() raised): the server was no longer paused then (the
    reference server's state) and answers a generation (within PROBE_S: not released by its own watchdog)."""
    assert now["paused_at_once"] is not True, f"{where}: still paused when publish() raised"
    assert now["generate_s"] is not None, f"{where}: no generation answered within {PROBE_S:g} s: still paused"


def answers_within(url: str, seconds: float) -> bool:
    """True when the server answers a 1-token generation within ``seconds`` (a paused one holds it)."""
    from bridge.client import ServerClient
    from bridge.errors import BridgeError

    try:
        ServerClient(url, timeout=seconds).generate(input_ids=[1, 4, 5], sampling_params={"max_new_tokens": 1})
        return True
    except BridgeError:
        return False
