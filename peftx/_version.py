"""peftx's version, in one place below every module that names it."""

__version__ = "0.1.0"
