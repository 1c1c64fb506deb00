"""Adapters and structured weights, each an implicit array with its handlers."""

from ._zeros import Zeros as Zeros
