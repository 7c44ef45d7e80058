"""Stand-in for ``vllm`` (vLLM, whose ops SGLang 0.4.x falls back to on a CPU without AMX) in the SGLang-code test tier.

SGLang 0.4.x imports ``vllm`` at module level in their layer code; PyPI has no CPU
build of it. The weight-update path never runs a kernel, so every ``vllm.*`` import succeeds and
every attribute is an inert placeholder that raises when called. Put on ``sys.path`` only for the
versions that need it.
"""

from _standin import install

__version__ = "0.0.0+wsync.standin"
install("vllm", globals())
