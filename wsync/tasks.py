"""A small synthetic task the tiny model visibly learns in a few steps: reverse a word.

Each example is ``"<bos>rev fsdp=pdsf<eos>"`` (no ``<bos>`` with a tokenizer that has none); the loss covers only the answer after ``=`` so the model is
graded on the reversal, and the demo's fixed prompt ``"rev wsync="`` shows its progress.
"""

from __future__ import annotations

import random

import torch
from tensordict import TensorDict

__all__ = ["ANSWER", "PROMPT", "make_batch", "pad_id", "prompt_ids"]

PROMPT = "rev wsync="
ANSWER = "cnysw"
"""The right answer to :data:`PROMPT`."""
# A small vocabulary, so the tiny model memorises the reversals within a few steps and the demo's
# fixed prompt (whose word is among them) visibly converges to the right answer "cnysw".
WORDS = ("wsync", "fsdp", "sglang", "bucket", "gloo", "etcd", "snapshot", "version")


def make_batch(tokenizer, batch_size: int, seed: int) -> TensorDict:
    """A padded batch of reversal examples with ``input_ids``, ``attention_mask`` and ``loss_mask``."""
    rng = random.Random(seed)
    rows, masks = [], []
    for _ in range(batch_size):
        word = rng.choice(WORDS)
        prompt = _bos(tokenizer) + tokenizer(f"rev {word}=", add_special_tokens=False)["input_ids"]
        answer = tokenizer(word[::-1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, rows))
    ids = torch.full((batch_size, width), pad_id(tokenizer), dtype=torch.long)
    attn = torch.zeros((batch_size, width), dtype=torch.long)
    loss = torch.zeros((batch_size, width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss[i, : len(m)] = torch.tensor(m)
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss}, batch_size=[batch_size])


def prompt_ids(tokenizer) -> list[int]:
    """Token ids of the demo's fixed prompt (after the tokenizer's BOS token, where it has one)."""
    return _bos(tokenizer) + tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def pad_id(tokenizer) -> int:
    """The tokenizer's padding token, else its EOS token (padding is masked out either way), else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _bos(tokenizer) -> list[int]:
    """The tokenizer's BOS token as a one-token prefix, or nothing: Qwen2's own tokenizers have none."""
    return [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
