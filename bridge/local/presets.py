"""Models and tokenizers built locally, so nothing is ever downloaded.

``make_model_dir(path, "tiny")`` writes a complete HF directory (config, generation config, safetensors
weights, tokenizer) for a Qwen2-style causal LM with seeded random weights (``tiny-llama``: a Llama, whose
SGLang model class reads every tensor back through ``/get_weights_by_name``); it loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` offline.

The tokenizer is byte-level: every UTF-8 byte is one token (ids 3..258) plus ``<pad>``, ``<bos>`` and
``<eos>`` (ids 0..2), so any text round-trips and the vocabulary stays tiny.

Example:
    >>> import tempfile, transformers
    >>> d = make_model_dir(tempfile.mkdtemp(), "tiny")
    >>> tok = transformers.AutoTokenizer.from_pretrained(d)
    >>> tok.decode(tok("hello")["input_ids"])
    'hello'
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from bridge.errors import ConfigError

__all__ = ["PRESETS", "build_config", "build_model", "build_tokenizer", "make_model_dir"]

_ONE_AT_A_TIME = threading.RLock()  # transformers' first imports and torch's generator: one model built at a time
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
VOCAB_SIZE = 272  # 3 specials + 256 bytes, rounded up to a multiple of 16

# Qwen2-style shapes (q/k/v carry biases, as Qwen2 does). Parameter counts include the (tied) embedding once.
# A preset may override the defaults of build_config (``tie_word_embeddings``, say).
PRESETS: dict[str, dict] = {
    # ~0.33 M params: tests and the demo.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # ~48 M params.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2),
    # ~192 M params.
    "medium": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4),
    # ~19 M params (39 MB in bfloat16) in 339 tensors: Qwen2.5-7B's layout (28 layers of q/k/v with
    # biases, o, gate/up/down and 2 norms; embedding, final norm, untied lm_head) at 1/14 of its width,
    # so a sync pays real models' per-tensor costs in seconds on a laptop (`wsync bench --sizes many`).
    "many": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False),
    # tiny's shapes as a Llama (no q/k/v biases, its own head): SGLang's Llama answers /get_weights_by_name for every
    # tensor, its Qwen2 for none, so the real-SGLang tests read each served tensor back from this one.
    "tiny-llama": dict(architecture="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}


def build_config(preset: str = "tiny"):
    """The ``Qwen2Config`` of a preset (``LlamaConfig`` where it says ``architecture="llama"``; byte-level
    vocabulary; tied embeddings unless the preset says otherwise)."""
    from transformers import LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    defaults = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    fields = dict(PRESETS[preset])
    config_class = LlamaConfig if fields.pop("architecture", "qwen2") == "llama" else Qwen2Config
    return config_class(**{**defaults, **fields})


def build_model(preset: str = "tiny", seed: int = 0):
    """A freshly initialised causal LM for ``preset``, seeded so every process builds the same weights (and every
    thread: torch's generator is the process's, so two threads that build at once would draw from it in turn and
    build other weights; one builds at a time)."""
    with _ONE_AT_A_TIME:
        import torch  # here, not at the top: the CLI reads PRESETS for its --help without paying for torch
        from transformers import AutoModelForCausalLM

        config = build_config(preset)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def build_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast`` built in memory (no files, no network)."""
    with _ONE_AT_A_TIME:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(set(pre_tokenizers.ByteLevel.alphabet()), key=lambda c: _byte_of(c))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in byte_chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=2048
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The presets' chat template, plain text (the byte-level vocabulary has no role tokens): what
``/v1/chat/completions`` renders messages with, on the reference server and on SGLang serving a preset's
model directory."""


def _byte_of(char: str) -> int:
    # GPT-2's byte-to-unicode map; sorting by it puts byte b at id 3 + b.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[char]


def make_model_dir(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> str:
    """Write a complete HF model directory for ``preset`` at ``path`` and return the path (from several threads at
    once too: :func:`build_model`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(preset, seed)
    model.generation_config.do_sample = False
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return str(path)
