"""What the test session's forkserver runs once before it forks ranks and reference servers
(:data:`tests.dist_utils.PRELOAD`): the imports every such process would otherwise repeat.

transformers imports a model's classes lazily, on first use, so importing ``transformers`` is not enough:
building the tiny preset and its tokenizer once here imports everything a rank or a server needs (about
2 s a process on 2 cores). Single-threaded on purpose (``OMP_NUM_THREADS=1``, set by tests/conftest.py
before the forkserver starts), and ``torch.set_num_threads`` is never called here: it creates torch's
pthreadpool, which a forked child then finds invalid ("Invalid thread pool!" from a loader thread of a
server, seen intermittently). Each forked process makes its own.
"""

import torch
import torch.distributed
import torch.distributed.fsdp
import torch.distributed.tensor
import transformers  # noqa: F401

from bridge.local.presets import build_model, build_tokenizer

with torch.no_grad():
    _model = build_model("tiny", seed=0)
    _model.generate(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2, dtype=torch.long), do_sample=False,
                    max_new_tokens=1, pad_token_id=0)
build_tokenizer()
del _model
