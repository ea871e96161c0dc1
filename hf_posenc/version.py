"""The library version, in its own module so that generated standalone code can name it without importing
the package."""

__version__ = "0.1.0"
