"""Stand-in for ``torchvision`` when real SGLang runs on a CPU host (see ../README.md): every ``torchvision.*``
module imports, every name in them is a placeholder that raises when used (image and video preprocessing,
which a text model never runs)."""

from _standin import install

__version__ = "0.0.0+wsync.cpu"
install("torchvision", globals())
