"""The version of symlib (recorded in every manifest)."""

__version__ = "0.1.0"
