"""Stand-in for ``sgl_kernel`` (SGLang's kernel package) when real SGLang runs on a CPU host (see ../README.md).

Exactly what SGLang 0.5.23 takes from it on a CPU without AMX: ``assign_req_to_token_pool_cpu`` (called for
every batch) in plain torch, ``copy_all_layer_kv_cache_cpu`` and seven names of speculative decoding, which
this project never enables, raising when called. Any other name raises ImportError naming it.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+wsync.cpu"

SPECULATIVE = ("copy_all_layer_kv_cache_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
               "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
               "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu")


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Request ``i``'s slots ``start_offset[i]:end_offset[i]`` in its row of ``req_to_token`` get the next
    ``end - start`` entries of ``out_cache_loc`` (what SGLang's triton kernel of the same name does)."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start]
        taken += end - start


def _speculative(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is speculative decoding's, which real SGLang on a "
                                  "CPU host runs without (start it without --speculative-algorithm)")

    refuse.__name__ = name
    return refuse


for _name in SPECULATIVE:
    globals()[_name] = _speculative(_name)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"the sgl_kernel stand-in for CPU hosts (inference_adapter/sglang_cpu) has no {name!r}: this "
                      "SGLang release needs more of its kernel package than 0.5.23 did on CPU; add it there")
