"""SGLang's own HTTP weight-update tests (their steps and checks: :mod:`tests.sglang_own_checks`) against the reference
server, as the real tier runs them against real SGLang 0.5.23 (``test_sglangs_own_http_weight_update_tests``)."""

from __future__ import annotations

from tests import sglang_own_checks as own


def test_sglangs_own_http_weight_update_tests(server_factory, tmp_path):
    from bridge.local.presets import make_model_dir

    model = make_model_dir(tmp_path / "model", "tiny-llama")
    other = make_model_dir(tmp_path / "other", "tiny-llama", seed=1)
    server = server_factory(model=model, preset=None)
    own.run_all(server.url, other)
