"""The ``wsync`` command line and the demo: the layer above ``trainer`` and ``inference_adapter``."""
