"""The package's version, ``ep_moe.__version__``: a module of its own at the bottom floor, so
that the autotune cache can stamp its files with it without importing the package's root
(which imports the layer)."""

__version__ = "0.1.0"
