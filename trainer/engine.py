"""The FSDP2 trainer engine: a Hugging Face causal LM sharded with ``fully_shard``, trained from TensorDicts.

One code path serves CPU (gloo) and GPU (NCCL); the device is CUDA exactly when CUDA is available.

Lifecycle, run identically on every rank (launch with torchrun, or call from an already initialised
default process group):

1. ``FSDPEngine(config).initialize()``: checks the model directory, joins (or creates) the default
   process group, builds the model on every rank, shards each decoder layer and then the root with
   ``fully_shard`` (those steps are :mod:`trainer.build`'s), and creates AdamW with its schedule.
2. ``train_batch(batch)`` per step with this rank's part of the global batch. Every rank runs the same
   number of forward/backward passes (the FSDP collectives need it), so a rank with fewer micro-batches
   runs zero-weight dummies (the ranks agree on the work first: :mod:`trainer.batch_plan`).
3. ``param_specs()`` / ``iter_full_tensors()`` feed a weight sync: the specs come from DTensor metadata
   without any communication; the iterator gathers one tensor at a time (a collective per tensor) and
   hands the full tensor to rank 0 only.
4. ``save`` / ``load`` in HF safetensors or DCP, optionally with optimizer and schedule state
   (``trainer.checkpoint``); ``destroy()`` at the end.

Example (``torchrun --nproc-per-node 2 script.py``):

    engine = FSDPEngine(EngineConfig(preset="tiny")).initialize()
    stats = engine.train_batch(TensorDict(input_ids=ids, attention_mask=mask, batch_size=[len(ids)]))
    for spec, tensor in engine.iter_full_tensors():  # tensor is None except on rank 0
        ...
    engine.destroy()
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch.distributed.tensor import DTensor

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.sources.shm import SharedGather, keep_newest
from bridge.tensors import ParamSpec
from trainer.batch_plan import BatchPlan, plan_batch
from trainer.build import apply_lora, check_model_dir, join_process_group, load_model, shard_model
from trainer.config import EngineConfig
from trainer.data import loss_token_count, next_token_loss
from trainer.lora import adapter_config_dict, adapter_name, base_name, is_adapter_param
from trainer.optim import build_optimizer, build_scheduler

__all__ = ["FSDPEngine", "LossFn", "LossWeightFn"]

logger = get_logger(__name__)

LossFn = Callable[[torch.Tensor, TensorDictBase], torch.Tensor]
"""``loss_fn(logits [b, l, V], micro_batch) -> scalar``: the mean loss over the micro-batch's tokens."""
LossWeightFn = Callable[[TensorDictBase], float]
"""``loss_weight_fn(micro_batch) -> float``: how much the micro-batch's mean loss weighs (e.g. its token count)."""


class FSDPEngine:
    """A causal LM trained with FSDP2 on every rank of the default process group. See the module docstring."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._model: torch.nn.Module | None = None
        self._tokenizer = None
        self._model_config = None
        self._generation_config = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._device = torch.device("cpu")
        self._owns_process_group = False
        self._version = 0
        self._step = 0  # successful optimizer steps
        self._tied_output_name: str | None = None  # e.g. "lm_head.weight" when it shares the embedding
        self._tied_input_name: str | None = None
        self._pad_token_id = 0
        self._publisher = None  # upload_weights' publisher, kept while its settings (_publisher_key) stay
        self._publisher_key: tuple | None = None

    # ------------------------------------------------------------------ set-up

    def initialize(self) -> FSDPEngine:
        """Join the process group, build and shard the model, create the optimizer. Returns ``self``.

        Raises:
            ConfigError: ``model_path`` does not exist or is not a causal-LM directory.
        """
        cfg = self.config
        start = time.perf_counter()
        hf_config = check_model_dir(cfg.model_path) if cfg.model_path is not None else None
        placement = join_process_group(cfg.init_timeout)
        self._device, self._mesh = placement.device, placement.mesh
        self._owns_process_group = placement.owns_process_group
        torch.manual_seed(cfg.seed)

        model, self._tokenizer = load_model(cfg, hf_config)
        self._model_config = model.config
        # Recorded before fully_shard, which renames the class to FSDP<name>.
        self._model_config.architectures = [type(model).__name__]
        self._generation_config = getattr(model, "generation_config", None)
        model = apply_lora(model, cfg)
        self._find_tied_names(model)
        pad = getattr(self._tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self._model_config, "pad_token_id", None)
        self._pad_token_id = int(pad) if pad is not None else 0

        shard_model(model, cfg, placement)
        self._model = model
        self._param_index: dict[str, torch.Tensor] | None = None
        self._adapter_index: dict[str, torch.Tensor] | None = None  # the adapter's parameters, built once
        self._adapter_spec_list: list[ParamSpec] | None = None
        self._adapter_scratch: dict = {}  # the adapter gather's send and receive buffers, reused (gather_bucket_into)
        self._shm_gather = SharedGather()  # the adapter's gather between ranks of one host (bridge.sources.shm)
        self._adapter_buckets: dict = {}  # dtype -> the adapter's bucket layout, built once
        self._adapter_views: dict = {}  # (id(bucket), buffer address) -> (bucket, buffer, its tensors' views)
        # Under LoRA only the adapter requires a gradient: the frozen base weights never reach AdamW.
        self._optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
        self._scheduler = build_scheduler(self._optimizer, cfg.optimizer)
        if self.rank == 0:
            n_params = sum(s.numel for s in self.param_specs())
            logger.info(
                "FSDP2 engine ready in %.1f s: %s (%.1f M params, tied=%s) on %d rank(s), device %s, param_dtype %s",
                time.perf_counter() - start, cfg.model_path or f"preset {cfg.preset}", n_params / 1e6,
                self.tie_word_embeddings, self.world_size, self._device, cfg.param_dtype,
            )
        return self

    def _find_tied_names(self, model: torch.nn.Module) -> None:
        from bridge.sources import tied_embedding_names

        tied = tied_embedding_names(model)
        self._tied_input_name, self._tied_output_name = (base_name(tied[0]), base_name(tied[1])) if tied else (None, None)

    def upload_weights(self, meta):
        """Publish the current weights as ``meta.version`` (collective: every rank calls it).

        ``meta`` is a :class:`trainer.meta.WeightUpdateMeta` (``type`` ``broadcast``/``nccl`` or ``disk``).
        The publisher (and, for broadcast, its process group with the servers) is kept across calls
        with the same settings. Returns the :class:`bridge.publisher.core.PublishResult`.
        """
        from bridge.publisher.core import WeightPublisher

        key = meta.config_key()
        if self._publisher_key != key:
            if self._publisher is not None:
                self._publisher.close()
            self._publisher, self._publisher_key = WeightPublisher(meta.publisher_config()), key
        result = self._publisher.publish(self, meta.version)
        self.version = meta.version
        return result

    def destroy(self) -> None:
        """Drop the model and optimizer; destroy the default process group if this engine created it."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = self._publisher_key = None
        self._model = self._optimizer = self._scheduler = self._param_index = None
        self._adapter_index = self._adapter_spec_list = None
        self._adapter_scratch, self._adapter_buckets, self._adapter_views = {}, {}, {}
        self._shm_gather.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def model(self) -> torch.nn.Module:
        self._check_initialized()
        return self._model

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def model_config(self):
        return self._model_config

    @property
    def generation_config(self):
        """The model's HF generation config (None when it has none); a checkpoint saves it."""
        return self._generation_config

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the output head shares the input embedding (SGLang then skips ``lm_head.weight``)."""
        return self._tied_output_name is not None

    @property
    def tied_names(self) -> tuple[str, str] | None:
        """(input embedding, output head) parameter names when the head shares the embedding (e.g.
        ``model.embed_tokens.weight``, ``lm_head.weight``), else None. A checkpoint leaves the head out."""
        if self._tied_output_name is None:
            return None
        return self._tied_input_name, self._tied_output_name

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def version(self) -> int:
        """The weight version the caller assigned to the current weights (starts at 0)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self._check_initialized()
        return self._optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        self._check_initialized()
        return self._scheduler

    @property
    def global_step(self) -> int:
        """Successful optimizer steps so far (skipped steps do not count); set by loading a checkpoint."""
        return self._step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._step = int(value)

    def _check_initialized(self) -> None:
        if self._model is None:
            raise RuntimeError("FSDPEngine is not initialized (call initialize(), and not after destroy())")

    # ------------------------------------------------------------------ training

    def train_batch(
        self,
        input: TensorDictBase,
        loss_fn: LossFn | None = None,
        loss_weight_fn: LossWeightFn | None = None,
    ) -> dict:
        """One optimizer step on this rank's ``input`` (a collective: every rank calls it).

        Each micro-batch's mean loss is scaled by its weight over the total weight of all ranks, times
        the world size (FSDP averages gradients over ranks), so the step equals one unsharded process
        training on the concatenation of every rank's batch.

        Args:
            input: ``input_ids`` and ``attention_mask`` ``[B, L]``, optionally ``loss_mask`` and any other
                ``[B, L, ...]`` or ``[B, ...]`` tensors the loss needs.
            loss_fn: ``(logits, micro_batch) -> mean loss``; default :func:`trainer.data.next_token_loss`.
            loss_weight_fn: ``micro_batch -> weight``; default: the number of target tokens.

        Returns:
            ``loss`` (weighted mean over all ranks), ``grad_norm``, ``lr`` (used by this step),
            ``update_successful`` (False when the gradient norm was not finite: nothing was changed),
            ``n_tokens`` (over all ranks) and ``n_microbatches`` (forward passes per rank).

        Raises:
            ConfigError: on every rank, when any rank's batch is empty or malformed, or when the loss
                weights sum to zero.
        """
        self._check_initialized()
        loss_fn = loss_fn or next_token_loss
        plan = self._plan(input, loss_weight_fn or loss_token_count)
        model, optimizer = self._model, self._optimizer
        model.train()
        optimizer.zero_grad(set_to_none=True)
        lr = self._scheduler.get_last_lr()[0]
        scale = self.world_size / plan.total_weight
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        for mb, weight in zip(plan.micro_batches, plan.weights):
            logits = self._logits(mb)
            if weight > 0:
                loss = loss_fn(logits, mb)
                loss_sum += loss.detach().double() * (weight / plan.total_weight)
                loss = loss * (weight * scale)
            else:
                # Padding micro-batch: it must still run backward so that the reduce-scatters match the
                # other ranks', but it contributes exactly zero (user loss_fn may give NaN on no tokens).
                loss = logits.sum() * 0.0
            loss.backward()
            del logits, loss

        grad_norm = self._clip_grad_norm()
        update_successful = math.isfinite(grad_norm)
        if update_successful:
            optimizer.step()
            self._scheduler.step()
            self._step += 1
        elif self.rank == 0:  # the norm is global: every rank skips, one line says so
            logger.warning("gradient norm is %s: skipping the optimizer step (weights unchanged)", grad_norm)
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        return dict(
            loss=float(loss_sum),
            grad_norm=grad_norm,
            lr=lr,
            update_successful=update_successful,
            n_tokens=plan.n_tokens,
            n_microbatches=len(plan.micro_batches),
        )

    @torch.no_grad()
    def eval_batch(
        self, input: TensorDictBase, loss_fn: LossFn | None = None, loss_weight_fn: LossWeightFn | None = None
    ) -> float:
        """The loss on ``input``, weighted over all ranks exactly as ``train_batch`` would (collective)."""
        self._check_initialized()
        loss_fn = loss_fn or next_token_loss
        plan = self._plan(input, loss_weight_fn or loss_token_count)
        self._model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        for mb, weight in zip(plan.micro_batches, plan.weights):
            logits = self._logits(mb)
            if weight > 0:
                loss_sum += loss_fn(logits, mb).double() * (weight / plan.total_weight)
        self._reshard()
        dist.all_reduce(loss_sum)
        return float(loss_sum)

    @torch.no_grad()
    def forward(self, input: TensorDictBase) -> torch.Tensor:
        """Logits ``[B, L, V]`` laid out like ``input`` (zeros at padding); a collective."""
        self._check_initialized()
        plan = self._plan(input, lambda mb: 1.0)
        self._model.eval()
        out = None
        n_rows, n_cols = input["input_ids"].shape
        for i, mb in enumerate(plan.micro_batches):
            logits = self._logits(mb)
            if i >= len(plan.packed):
                continue  # a padding micro-batch
            if out is None:
                out = logits.new_zeros((n_rows, n_cols, logits.shape[-1]))
            real = mb["attention_mask"].bool()
            src = plan.packed[i]
            rows = src.rows.to(logits.device).unsqueeze(1).expand_as(real)[real]
            cols = src.cols.to(logits.device)[real]
            out[rows, cols] = logits[real]
        self._reshard()
        return out

    def _plan(self, input: TensorDictBase, loss_weight_fn: LossWeightFn) -> BatchPlan:
        """This rank's share of the step, agreed with the other ranks (collective; see :mod:`trainer.batch_plan`)."""
        return plan_batch(input, loss_weight_fn, mb_max_tokens=self.config.mb_max_tokens,
                          pad_token_id=self._pad_token_id, device=self._device)

    def _logits(self, mb: TensorDictBase) -> torch.Tensor:
        return self._model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits

    def _reshard(self) -> None:
        # FSDP2 keeps the root unit unsharded after a forward, expecting the backward; without one
        # (eval, forward) the full root parameters would stay allocated and replace the DTensors.
        self._model.reshard()

    def _clip_grad_norm(self) -> float:
        """Global L2 norm of the gradients (clipped to ``max_grad_norm`` when finite), as a plain float."""
        params = [p for p in self._model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        value = float(norm)
        max_norm = self.config.optimizer.max_grad_norm
        if max_norm and math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return value

    # ------------------------------------------------------------------ weights for a sync

    def param_specs(self) -> list[ParamSpec]:
        """HF names, global shapes and dtypes of the parameters, in the same order on every rank.

        Read from DTensor metadata; nothing is gathered. The tied output head (``lm_head.weight`` when
        it shares the embedding) is left out, as SGLang expects. Under LoRA these are the frozen base
        weights under their HF names (PEFT's wrapper names taken off); the adapter is :meth:`adapter_specs`.
        """
        self._check_initialized()
        return [
            ParamSpec(name, tuple(p.shape), p.dtype)
            for name, p in self._params_by_name().items()  # FSDP2 adds no prefix to the HF names
            if name != self._tied_output_name
        ]

    def iter_full_tensors(
        self, specs: Sequence[ParamSpec] | None = None
    ) -> Iterator[tuple[ParamSpec, torch.Tensor | None]]:
        """Gather each parameter in ``specs`` order: the full tensor on rank 0, None elsewhere.

        A collective: every rank must call it with the same specs and consume it to the end. A spec
        whose dtype differs from the parameter's is cast before the gather (half the traffic for a
        bfloat16 sync of float32 weights). Only the current tensor is alive at any time.

        Raises:
            ConfigError: a spec names no parameter or has the wrong shape.
        """
        self._check_initialized()
        specs = self.param_specs() if specs is None else specs
        params = self._params_by_name()
        rank0 = self.rank == 0
        for spec in specs:
            param = params.get(spec.name)
            if param is None:
                raise ConfigError(f"no parameter named {spec.name!r}; use names from param_specs()")
            if tuple(param.shape) != tuple(spec.shape):
                raise ConfigError(f"{spec.name!r} has shape {tuple(param.shape)}, the spec says {tuple(spec.shape)}")
            full = self._gather(param.detach(), spec.dtype)
            if rank0:
                yield spec, full
                del full  # the consumer decides how long the tensor lives, not this frame
            else:
                del full  # nothing to hand out: free it before yielding
                yield spec, None

    def _params_by_name(self) -> dict[str, torch.Tensor]:
        """Name -> parameter (DTensor under FSDP2), built once: the parameter objects outlive every step,
        and rebuilding the map per bucket was most of the per-tensor gather on a 339-tensor model."""
        if self._param_index is None:
            self._param_index = {base_name(n): p for n, p in self._model.named_parameters(remove_duplicate=False)
                                 if not is_adapter_param(n)}
        return self._param_index

    def gather_bucket(self, bucket, out: torch.Tensor | None, group=None, dst: int = 0) -> None:
        """Collective: write a whole bucket's full parameters into rank ``dst``'s wire buffer ``out``.

        The fast path of a sync (see :func:`bridge.sources.gather_bucket_into`): FSDP2 shards travel in
        a few flat gathers to rank ``dst`` instead of one all-gather per parameter. Other ranks pass None.
        """
        from bridge.sources import gather_bucket_into

        self._check_initialized()
        params = self._params_by_name()
        missing = [s.name for s in bucket.specs if s.name not in params]
        if missing:
            raise ConfigError(f"no parameters named {missing}; use names from param_specs()")
        gather_bucket_into([(s, params[s.name]) for s in bucket.specs], bucket, out, group=group, dst=dst)

    def local_digest(self) -> int:
        """CRC32 of this rank's shards of the published parameters (see :func:`bridge.sources.local_digest`)."""
        from bridge.sources import local_digest

        self._check_initialized()
        params = self._params_by_name()
        return local_digest((s.name, params[s.name]) for s in self.param_specs())

    def local_shards(self, specs):
        """This rank's own rows of each parameter in ``specs``, no communication (the delta encoding's
        input; see :func:`bridge.sources.local_shards_of`)."""
        from bridge.sources import local_shards_of

        self._check_initialized()
        params = self._params_by_name()
        return local_shards_of([(s, params[s.name]) for s in specs])

    def _gather(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return param.to(dtype).contiguous()
        if param.dtype != dtype:
            param = param.to(dtype)
        if param.device.type != self._mesh.device_type:
            # CPU-offloaded shards under NCCL: the collective needs them on the device.
            param = DTensor.from_local(
                param.to_local().to(self._device), param.device_mesh, param.placements,
                shape=param.shape, stride=param.stride(),
            )
        return param.full_tensor().contiguous()

    # ------------------------------------------------------------------ the LoRA adapter

    @property
    def lora(self) -> bool:
        """True when the engine trains a LoRA adapter (``EngineConfig(lora=...)``) on frozen base weights."""
        return self.config.lora is not None

    def adapter_specs(self) -> list[ParamSpec]:
        """The adapter's parameters as PEFT's ``adapter_model.safetensors`` names them, with global shapes
        and dtypes, in the same order on every rank (no communication).

        Raises:
            ConfigError: the engine trains no adapter.
        """
        params = self._adapter_params()
        if self._adapter_spec_list is None:  # a DTensor's shape costs ~10 us: 224 of them, once
            self._adapter_spec_list = [ParamSpec(name, tuple(p.shape), p.dtype) for name, p in params.items()]
        return list(self._adapter_spec_list)

    def adapter_config(self) -> dict:
        """The adapter's PEFT ``adapter_config.json`` as a dict (``base_model_name_or_path`` the model path)."""
        self._adapter_params()  # raises without an adapter (the index is built once)
        return adapter_config_dict(self._model, base_model=self.config.model_path or f"wsync-preset-{self.config.preset}")

    def gather_adapter(self, dtype: torch.dtype | None = None, dst: int = 0, shared: bool = False,
                       reuse: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
        """Collective: the adapter's full tensors (``adapter_specs`` names, cast to ``dtype`` when given)
        on rank ``dst``, None on the others.

        An adapter is small (rank 16 on every projection of an 8B model: tens of MB), so it travels as one
        bucket: ``dst`` holds the bucket's buffer and nothing more; the tensors returned are views of it. Ranks on
        one host (CPU, gloo) write their rows straight into that buffer in shared memory
        (:class:`bridge.sources.shm.SharedGather`); elsewhere it
        goes through :func:`bridge.sources.gather_bucket_into`, the full sync's flat gathers. ``shared`` (CPU): that
        buffer in shared memory under torch's ``file_system`` strategy, which a server on this host maps when the
        tensors are sent by reference (``/load_lora_adapter_from_tensors``), with no copy into shared memory first.
        ``reuse``: the buffer an earlier gather's tensors are views of (their storage as a 1-D uint8 tensor), once no
        one uses them any more, gathered into again on rank ``dst`` when it fits (1-D uint8 of the adapter's bytes in ``dtype`` on this engine's device;
        else a fresh buffer): fresh memory costs a page fault per page at its first write, more than the copies.
        """
        from bridge.buckets import Bucket, unflatten_bucket
        from bridge.sources import PIECE_BYTES, gather_bucket_into
        from bridge.sources.shm import shared_buffer

        params = self._adapter_params()
        bucket = self._adapter_buckets.get(dtype)
        if bucket is None:  # kept per dtype: the same layout at every publish
            specs = self.adapter_specs()
            if dtype is not None:
                specs = [ParamSpec(s.name, s.shape, dtype) for s in specs]
            bucket = Bucket(sorted(specs, key=lambda s: -s.dtype.itemsize))  # aligned offsets (one dtype: kept order)
            self._adapter_buckets[dtype] = bucket
        # Ranks on one host (CPU): each writes its rows straight into dst's buffer in shared memory (bridge.sources.shm).
        through_shm = self._device.type == "cpu" and bucket.nbytes > 0 and self._shm_gather.usable(dst)
        # (a buffer that does not fit is not an error raised here: rank dst alone would leave the collective)
        fits = reuse is not None and reuse.dtype == torch.uint8 and reuse.dim() == 1 and reuse.numel() == bucket.nbytes \
            and reuse.device == self._device and (not through_shm or reuse.untyped_storage().is_shared())
        if self.rank != dst:
            out = None
        elif fits:
            out = reuse
        elif (shared or through_shm) and self._device.type == "cpu" and bucket.nbytes:
            out = shared_buffer(bucket.nbytes)
        else:
            out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._device)
        items = [(s, params[s.name]) for s in bucket.specs]
        if through_shm:
            self._shm_gather.gather(items, bucket, out, dst=dst)
        else:
            # Pieces as large as the full sync's largest (16 MiB): an adapter of tens of MB is a few gathers, not one
            # per MiB (rank dst holds world x piece beside the adapter, a few times the adapter at most).
            gather_bucket_into(items, bucket, out, dst=dst, piece_bytes=PIECE_BYTES, scratch=self._adapter_scratch)
        if out is None:
            return None
        # The same few buffers come back: their views are kept (with the buffer, so its address stays its own).
        views = keep_newest(self._adapter_views, (id(bucket), out.untyped_storage().data_ptr()),
                            lambda: (bucket, out, dict(unflatten_bucket(out, bucket.specs))),
                            valid=lambda kept: kept[0] is bucket)
        return dict(views[2])

    def _adapter_params(self) -> dict[str, torch.Tensor]:
        self._check_initialized()
        if not self.lora:
            raise ConfigError("this engine trains no LoRA adapter; create it with EngineConfig(lora=LoraConfig(...))")
        if self._adapter_index is None:  # built once, as _params_by_name: the parameter objects outlive every step
            self._adapter_index = {adapter_name(n): p for n, p in self._model.named_parameters() if is_adapter_param(n)}
        return self._adapter_index

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike, weight_format: str = "hf", with_optim: bool = False) -> None:
        """Write the weights (and optionally optimizer + schedule state); a collective.
        See :func:`trainer.checkpoint.save`."""
        from trainer import checkpoint

        self._check_initialized()
        if self.lora and weight_format == "hf":
            raise ConfigError("an engine training a LoRA adapter saves in weight_format='dcp' (model and adapter); "
                              "the adapter alone goes out by an adapter publish (docs/lora.md)")
        checkpoint.save(self, path, weight_format, with_optim)

    def load(self, path: str | os.PathLike, weight_format: str = "hf", with_optim: bool = False) -> None:
        """Load what :meth:`save` wrote (in place, bit-exact); a collective. See :func:`trainer.checkpoint.load`."""
        from trainer import checkpoint

        self._check_initialized()
        checkpoint.load(self, path, weight_format, with_optim)
