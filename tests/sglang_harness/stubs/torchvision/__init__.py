"""Stand-in for ``torchvision`` in the SGLang-code test tier (never a real torchvision).

PyPI's torchvision wheel needs CUDA libraries this CPU machine lacks, yet SGLang (and some transformers
modules) import it at module level for image/video preprocessing, which the weight-sync tests never run.
Every ``torchvision.*`` module imports; every attribute is an inert placeholder that raises when used.
"""

from _wsync_standin import install

__version__ = "0.0.0+wsync.standin"
install("torchvision", globals())
