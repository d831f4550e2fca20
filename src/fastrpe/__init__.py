"""fastrpe: attention with relative positional encoding, fast on long sequences."""
from . import kernels, positions  # noqa: F401

__version__ = "0.1.0"
