"""peftx: parameter-efficient fine-tuning for JAX and Equinox."""

from . import adapters as adapters, implicit as implicit
from .implicit import (
    ImplicitArray as ImplicitArray,
    use_implicit_args as use_implicit_args,
)

__version__ = "0.1.0"
