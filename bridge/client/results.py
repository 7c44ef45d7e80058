"""What a generation's answer says about the weights it ran on.

From SGLang 0.5.20 every finished ``/generate`` result has ``meta_info.weight_versions``: the spans of its output
tokens under each version (``[{"version", "start", "end"}, ...]``; a request paused ``in_place`` across a sync, or
relabelled, ran on more than one), and the OpenAI routes put the same in ``metadata.weight_versions`` of a
non-streamed answer. Older servers report one ``weight_version`` per answer (0.5.1+), or none.
:func:`generation_versions` reads whichever is there, so a rollout can weight each token by the version that
produced it (asynchronous RL, per-token importance weights) on any server.

Example:
    >>> generation_versions({"output_ids": [7, 8, 9], "meta_info": {"weight_version": "3",
    ...     "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]}})
    [{'version': '2', 'start': 0, 'end': 1}, {'version': '3', 'start': 1, 'end': 3}]
    >>> generation_versions({"output_ids": [7, 8], "meta_info": {"weight_version": "5"}})
    [{'version': '5', 'start': 0, 'end': 2}]
"""

from __future__ import annotations

__all__ = ["generation_versions", "versions_text"]


def generation_versions(result: dict) -> list[dict]:
    """The spans of output tokens per weight version of one answer: a ``/generate`` result (``meta_info``) or a
    non-streamed ``/v1/completions`` / ``/v1/chat/completions`` response (``metadata``, first choice).

    Where the server reports spans they are returned as they are; where it reports one version, one span
    covering every output token; where it reports none (SGLang < 0.5.1), ``[]``.
    """
    meta = result.get("meta_info") or result.get("metadata") or {}
    if "weight_versions" in meta:
        return [dict(sp) for sp in meta["weight_versions"]]
    if meta.get("weight_version") is None:
        return []
    if "output_ids" in result:
        n = len(result["output_ids"])
    elif "completion_tokens" in meta:
        n = meta["completion_tokens"]
    else:  # an OpenAI response: its usage counts every choice's tokens; the version is the first choice's
        n = (result.get("usage") or {}).get("completion_tokens", 0)
    return [{"version": str(meta["weight_version"]), "start": 0, "end": n}]


def versions_text(spans: list[dict]) -> str:
    """Spans in one short word: ``3`` for one version, ``2[0:5]+3[5:12]`` for several, ``-`` for none."""
    if len(spans) == 1:
        return spans[0]["version"]
    return "+".join(f"{sp['version']}[{sp['start']}:{sp['end']}]" for sp in spans) or "-"
