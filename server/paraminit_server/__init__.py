"""paraminit server: validates initialization plans and materializes them on a backend."""

__version__ = "0.1.0"
