"""hylinker: off-GPU prefix caching for hybrid models."""

__version__ = "0.1.0"
