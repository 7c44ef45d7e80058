"""Stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package) in the SGLang-code test tier.

SGLang releases before 0.5.23 import ``sgl_kernel`` at module level in their layer code; PyPI has no CPU
build of it. The weight-update path never runs a kernel, so every ``sgl_kernel.*`` import succeeds and
every attribute is an inert placeholder that raises when called. Put on ``sys.path`` only for the
versions that need it.
"""

from _standin import install

__version__ = "0.0.0+wsync.standin"
install("sgl_kernel", globals())
