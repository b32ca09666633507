"""Single source of this distribution's version (read by hatchling and at runtime)."""

__version__ = "0.1.0"
