"""SGLang's HTTP weight-update protocol: version features, request bodies, shared wording.

Both sides use this module: :mod:`bridge.client` decides from :class:`ProtocolFeatures` which fields and
routes a server of a given SGLang version understands, and the reference server
(:mod:`inference_adapter.server`) parses request bodies with the pydantic models below, which mirror
SGLang 0.5.23's request structs field by field (``shared/docs/sglang-0.5.23-request-fields.json``):
unknown keys are ignored and values are coerced laxly (``"master_port": "29500"`` is an int), as
SGLang does.

Example:
    >>> f = ProtocolFeatures.from_version("0.5.10.post1")
    >>> f.flattened_bucket, f.needs_session
    (True, False)
    >>> ProtocolFeatures.from_version("0.5.5").server_info_route
    '/get_server_info'
    >>> InitWeightsUpdateGroupReq.model_validate(
    ...     {"master_address": "h", "master_port": "29500", "rank_offset": 1, "world_size": 2, "x": 0}
    ... ).master_port
    29500
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from bridge.errors import ConfigError

__all__ = [
    "ADMIN_ROUTES",
    "ANOTHER_WRITER",
    "AbortReq",
    "DEFAULT_GROUP_NAME",
    "SESSION_REQUIRED_MESSAGE",
    "SHM_LOAD_FORMAT",
    "SNAPSHOT_INVALID",
    "DELTA_BASE_MISMATCH",
    "WAITING_FOR_WEIGHTS",
    "PICKLE_REFUSED",
    "VERSION_GOES_BACK",
    "BeginWeightUpdateReq",
    "ContinueGenerationReq",
    "DestroyWeightsUpdateGroupReq",
    "GenerateReq",
    "GetWeightsByNameReq",
    "InitWeightsUpdateGroupReq",
    "LoadLoRAAdapterFromTensorsReq",
    "LoadLoRAAdapterReq",
    "MemoryOccupationReq",
    "PauseGenerationReq",
    "ProtocolFeatures",
    "SamplingParams",
    "UnloadLoRAAdapterReq",
    "UpdateWeightFromDiskReq",
    "UpdateWeightVersionReq",
    "UpdateWeightsFromDistributedReq",
    "UpdateWeightsFromTensorReq",
    "WeightsChecksumReq",
    "describe_validation_error",
    "wire_dtype",
    "parse_version",
    "DELTA_LOADER",
    "ZSTD_SGLANG",
]

DEFAULT_GROUP_NAME = "weight_update_group"

# SGLang >= 0.5.21 refuses tensor/distributed updates outside a session with this wording.
SESSION_REQUIRED_MESSAGE = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)

# Project extension of /update_weights_from_tensor (reference server only): the serialized entry is base64
# of JSON {"path", "nbytes", "names", "dtypes", "shapes"} naming a shared-memory file, not a pickle.
SHM_LOAD_FORMAT = "wsync_shm"

VERSION_GOES_BACK = "version_goes_back"
"""``wsync_reason`` of the reference server's 400 for a version older than the served one without a new
run; the client raises :class:`bridge.errors.VersionError` for it."""

ANOTHER_WRITER = "another_writer"
"""``wsync_reason`` of the reference server's 409 for a weight change while another writer holds the server: a
writer (``wsync_writer``, with its run ``wsync_run_id``) holds it from ``/wsync/writer_lease`` until it releases
it or its lease runs out; the message names the holder's run and writer."""

SNAPSHOT_INVALID = "snapshot_invalid"
"""``wsync_reason`` of the reference server's 400 for a snapshot that fails verification against its
manifest (or whose manifest is not the announced one, ``wsync_manifest_sha256``); the disk watcher then
falls back to the newest older announced version, as when it verifies a snapshot itself."""

PICKLE_REFUSED = "pickle_refused"
"""``wsync_reason`` of the reference server's 400 for a ``/update_weights_from_tensor`` pickle it does not open: a
global outside SGLang 0.5.23's allowlist, a CUDA tensor, a handle of torch's ``file_descriptor`` strategy, or not
SGLang's payload shape (:mod:`inference_adapter.tensor_payload`)."""

QUANTIZATION_MISMATCH = "quantization_mismatch"
"""``wsync_reason`` of the reference server's 400 for FP8 bytes sent to a server that serves a tensor in bf16 (it was
not started with ``--quantization fp8``), or bf16 bytes for a tensor it serves as FP8; nothing was applied."""

DELTA_BASE_MISMATCH = "delta_base_mismatch"
"""``wsync_reason`` of the reference server's 400 for a delta whose base (version and digest) is not what it
serves; nothing was applied, and the publisher answers with an anchor (a full sync)."""

WAITING_FOR_WEIGHTS = "waiting_for_weights"
"""``wsync_reason`` of the reference server's 503 to a generation while it waits for its first weights (``wsync serve
--wait-for-weights``: restarted or new in a fleet, it answers nothing on its base weights); a router retries it on
another server."""

DELTA_LOADER = "bridge.serving.sglang_delta_loader.load_delta"
"""The loader real SGLang calls for a delta (:mod:`bridge.serving.sglang_delta_loader`): ``--custom-weight-loader``
and the request's ``load_format`` name it."""

ZSTD_SGLANG = (0, 5, 20)
"""The first SGLang release that requires the ``zstandard`` package: before it, its environment may lack it."""

_VERSION_RE = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; ``"0.5.23rc1"`` -> ``(0, 5, 23)``.

    Pre-, post- and dev-release suffixes are dropped: a release candidate already has the features of
    its release.

    Raises:
        ConfigError: the string does not start with a numeric version.
    """
    m = _VERSION_RE.match(str(version))
    if m is None:
        raise ConfigError(f"cannot parse SGLang version {version!r}; expected something like '0.5.23' or '0.5.10.post1'")
    return tuple(int(g) if g is not None else 0 for g in m.groups())  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class ProtocolFeatures:
    """What a server speaking SGLang version ``version`` supports.

    Every gate is pinned by running SGLang's own code of the release on either side of it
    (``tests/test_sglang_versions.py``; ``scripts/install_sglang.sh`` lists the releases);
    ``shared/docs/sglang-protocol.md`` section 9 is older than these and wrong on several of them.
    """

    version: str
    """The version string as the server reported it (``/server_info`` or ``/get_server_info`` ``version``)."""
    release: tuple[int, int, int]
    """The parsed ``(major, minor, patch)``."""
    needs_session: bool
    """>= 0.5.21: distributed/tensor updates must run between begin_weight_update and end_weight_update."""
    flattened_bucket: bool
    """>= 0.5.6: ``load_format="flattened_bucket"`` (one uint8 broadcast per request) is accepted; older
    request structs have no ``load_format`` and drop it, then wait for one broadcast per tensor."""
    destroy_group: bool
    """>= 0.5.3: ``/destroy_weights_update_group`` exists."""
    pause_mode: bool
    """>= 0.5.6: ``/pause_generation`` takes a ``mode`` (abort, retract, in_place); older ones abort."""
    weight_version: bool
    """>= 0.5.1: ``weight_version`` fields and ``/update_weight_version`` exist."""
    batched_distributed: bool
    """>= 0.4.9: ``/update_weights_from_distributed`` takes lists (names/dtypes/shapes), not one tensor."""
    get_weight_version_route: bool
    """0.5.1 <= v < 0.5.8: ``/get_weight_version`` answers (an alias of ``/weight_version`` in 0.5.6-0.5.7; from 0.5.8
    both answer 404, "deprecated")."""
    weight_version_route: bool
    """0.5.6 <= v < 0.5.8: ``GET /weight_version`` answers ``{"weight_version"}`` (0.5.8-0.5.22 answer 404,
    "deprecated"; 0.5.23 has no such route)."""
    info_routes: bool
    """>= 0.5.6: ``/server_info`` and ``/model_info``; older servers have only ``/get_server_info`` and
    ``/get_model_info`` (which 0.5.6+ keep as aliases)."""
    weight_version_spans: bool
    """>= 0.5.20: every finished request's ``meta_info`` has ``weight_versions``, the spans of its output tokens
    generated under each weight version (``[{"version", "start", "end"}, ...]``, recorded for the requests in
    flight whenever the version label changes), and ``weight_version`` is the version it finished on; older
    releases report only ``weight_version``, the tokenizer side's label. ``sglang/srt/utils/weight_versions.py``
    (``record_weight_version_events``, ``compute_weight_version_spans``, ``add_weight_versions_to_meta_info``)
    is the same file in 0.5.20-0.5.23 and absent from 0.5.8, the release installed before 0.5.20, so the gate
    starts at the first installed release that has it."""
    flush_asserts: bool
    """v < 0.5.22: the scheduler's update handlers ``assert flush_cache_success`` after an update with
    ``flush_cache``, and the flush is refused while a request is running, so a refused flush kills the
    server; 0.5.22+ fail the update instead ("the cache was not flushed"). Read in SGLang's source of
    0.4.9, 0.4.10, 0.5.1-0.5.3, 0.5.5-0.5.10, 0.5.15, 0.5.19-0.5.21 (assert) and 0.5.22, 0.5.23 (fail).
    Only 0.5.6+ can pause ``in_place`` (older pauses abort every request), which keeps requests running:
    an update asking for a flush while paused in place kills 0.5.6-0.5.21 and fails on 0.5.22+. Either
    way an update must not ask for a flush while generations are paused in place, and the client never
    does (:meth:`bridge.client.ServerClient.pause_generation`)."""

    @property
    def flush_refused_while_retracted(self) -> bool:
        """0.5.9-0.5.20: the scheduler's ``flush_cache`` counts the waiting queue, where a ``retract`` pause puts
        the requests in flight, so an update that asks for a flush while paused that way is refused (and, with
        :attr:`flush_asserts`, kills the server). Seen running SGLang's own code (``tests/test_sglang_versions.py``):
        a retract-paused flushing update with a request in flight succeeds on 0.5.8 and 0.5.21 and kills 0.5.20's
        scheduler; in the source, 0.5.20's ``flush_cache`` checks ``is_fully_idle()``, waiting queue included,
        0.5.21 added ``ignore_waiting`` while paused, and 0.5.6-0.5.8's ``_is_no_request`` counts only running
        batches. No release between 0.5.8 and 0.5.20 is installed, so the gate starts at the first of them; the
        client then sends no flush (as paused in place)."""
        return (0, 5, 9) <= self.release < (0, 5, 21)

    @property
    def default_pause_mode(self) -> str:
        """The mode ``pause_mode="auto"`` pauses with: one that keeps the requests in flight (they go on after
        the update instead of coming back aborted), where this version has one whose update can still flush the
        cache. ``retract`` (0.5.6-0.5.8 and 0.5.21+: requests are re-queued and recomputed on the new weights, and
        the flush ignores them); ``in_place`` (0.5.9-0.5.20, :attr:`flush_refused_while_retracted`: requests keep
        their cache, and the client sends no flush while paused so); ``abort`` before 0.5.6, which has no modes."""
        if not self.pause_mode:
            return "abort"
        return "in_place" if self.flush_refused_while_retracted else "retract"

    @property
    def version_lost_when_paused(self) -> bool:
        """0.5.6 only: an update sent while the server is paused returns before the tokenizer side records its
        ``weight_version`` (0.5.1-0.5.5 record it in the HTTP route, 0.5.7 fixed the tokenizer side); the client
        then sets it explicitly."""
        return (0, 5, 6) <= self.release < (0, 5, 7)

    @classmethod
    def from_version(cls, version: str) -> ProtocolFeatures:
        r = parse_version(version)
        return cls(
            version=str(version),
            release=r,
            needs_session=r >= (0, 5, 21),
            flattened_bucket=r >= (0, 5, 6),
            destroy_group=r >= (0, 5, 3),
            pause_mode=r >= (0, 5, 6),
            weight_version=r >= (0, 5, 1),
            batched_distributed=r >= (0, 4, 9),
            get_weight_version_route=(0, 5, 1) <= r < (0, 5, 8),
            weight_version_route=(0, 5, 6) <= r < (0, 5, 8),
            info_routes=r >= (0, 5, 6),
            weight_version_spans=r >= (0, 5, 20),
            flush_asserts=r < (0, 5, 22),
        )

    @property
    def lora_from_tensors(self) -> bool:
        """>= 0.5.8: ``/load_lora_adapter_from_tensors`` exists (0.5.7's source has no such route)."""
        return self.release >= (0, 5, 8)

    @property
    def lora_tensors_per_rank(self) -> bool:
        """>= 0.5.20: ``/load_lora_adapter_from_tensors`` takes ``serialized_named_tensors`` (one base64 entry per TP
        rank, with ``load_format`` and ``expected_checksums``); 0.5.8 takes one string ``serialized_tensors``. The
        change (SGLang PR 32580) lies between 0.5.8 and 0.5.20, the installed releases on either side of it, so
        the gate starts at the first installed release that has the list."""
        return self.release >= (0, 5, 20)

    @property
    def server_info_route(self) -> str:
        return "/server_info" if self.info_routes else "/get_server_info"

    @property
    def model_info_route(self) -> str:
        return "/model_info" if self.info_routes else "/get_model_info"


# SGLang's control routes, marked ADMIN_OPTIONAL in its http_server.py (srt/utils/auth.py decides): with
# --admin-api-key set only that key opens them; every other route (generate, info) takes --api-key.
ADMIN_ROUTES = frozenset({
    "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
    "/update_weight_version", "/pause_generation", "/continue_generation", "/flush_cache", "/get_weights_by_name",
    "/release_memory_occupation", "/resume_memory_occupation", "/abort_request", "/weights_checker", "/wsync/weights_checksum", "/wsync/bench/recv_raw",
    "/wsync/abort_weight_update", "/wsync/writer_lease", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter", "/wsync/lora_checksum", "/wsync/load_lora_adapter_from_distributed",
})


def wire_dtype(dtype: Any) -> str:
    """A dtype as the wire names it: ``torch.bfloat16`` or ``"torch.bfloat16"`` -> ``"bfloat16"`` (SGLang resolves
    ``getattr(torch, name)``: the bare attribute name)."""
    return str(dtype).removeprefix("torch.")


def describe_validation_error(route: str, e: ValidationError) -> str:
    """One line naming every bad field: ``/route: field 'master_port': Input should be a valid integer (got 'x')``."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "(body)"
        if err.get("type") == "missing":
            parts.append(f"field '{loc}': required")
            continue
        shown = repr(err.get("input"))
        if len(shown) > 60:
            shown = shown[:57] + "..."
        parts.append(f"field '{loc}': {err.get('msg')} (got {shown})")
    return f"invalid request body for {route}: " + "; ".join(parts)


class _Req(BaseModel):
    # SGLang >= 0.5.16 builds its schemas with extra="ignore"; older dataclass bodies ignore extras too.
    model_config = ConfigDict(extra="ignore")
    rid: str | None = None


class InitWeightsUpdateGroupReq(_Req):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedReq(_Req):
    # Lists since SGLang ~0.4.9; the single-tensor form (name/dtype/shape) of older versions is folded
    # into these by the server when it emulates such a version.
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorReq(_Req):
    # Entries may be bytes for SGLang's Python Engine; over HTTP they are base64 strings.
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class LoadLoRAAdapterReq(_Req):
    """SGLang's ``LoadLoRAAdapterReqInput`` (``/load_lora_adapter``); ``pinned`` from 0.5.1."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class LoadLoRAAdapterFromTensorsReq(_Req):
    """SGLang 0.5.20+'s ``LoadLoRAAdapterFromTensorsReqInput``; 0.5.8's has ``serialized_tensors: str`` instead of
    the per-TP-rank list and no ``load_format``/``expected_checksums``
    (:attr:`ProtocolFeatures.lora_tensors_per_rank`)."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str] | None = None
    serialized_tensors: str | None = None
    pinned: bool = False
    added_tokens_config: dict[str, Any] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UnloadLoRAAdapterReq(_Req):
    """SGLang's ``UnloadLoRAAdapterReqInput`` (``/unload_lora_adapter``)."""

    lora_name: str
    lora_id: str | None = None


class UpdateWeightFromDiskReq(_Req):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class DestroyWeightsUpdateGroupReq(_Req):
    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightVersionReq(_Req):
    new_version: str
    # SGLang's default is True here (unlike the update routes).
    abort_all_requests: bool = True


class GetWeightsByNameReq(_Req):
    name: str
    truncate_size: int = 100


class PauseGenerationReq(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReq(_Req):
    torch_empty_cache: bool = True


class MemoryOccupationReq(_Req):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``: ``tags`` among ``kv_cache``, ``weights``,
    ``cuda_graph``; none or empty means all three."""

    tags: list[str] | None = None


class AbortReq(_Req):
    """``/abort_request``: the request ``rid``, or every request (``abort_all``)."""

    abort_all: bool = False


class BeginWeightUpdateReq(_Req):
    selector: Literal["target", "draft", "all"] = "all"


class WeightsChecksumReq(_Req):
    """Body of the project's ``/wsync/weights_checksum`` extension route (not SGLang). ``digest``: answer the
    :func:`bridge.digest.served_digest_part` sum of the named tensors (and the served run) instead of their checksums."""

    names: list[str] | None = None
    digest: bool = False


class SamplingParams(BaseModel):
    """The sampling parameters the reference server honours; the others SGLang knows are ignored."""

    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    seed: int | None = None


class GenerateReq(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    # The LoRA adapter (its name) each prompt runs with; None: the base model (SGLang's GenerateReqInput.lora_path).
    lora_path: str | list[str | None] | None = None
