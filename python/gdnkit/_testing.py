"""Hooks for gdnkit's own tests; not part of the API and may change without notice."""

from __future__ import annotations

from ._gdnkit import _testing as _ext

__all__ = ["raise_error"]


def raise_error(mode: int) -> None:
    """Raise a library error along one of the ways an error can reach Python.

    Parameters
    ----------
    mode : {0, 1, 2, 3}
        0: a ``gdnkit::Error`` thrown by the binding with the GIL released; 1: a library error with the
        GIL held; 2: a library error through the path every op takes; 3: a library error with the GIL
        released. Modes 1-3 raise ``"q: H=3 does not divide HV=4"``, mode 0
        ``"debug: thrown by the binding"``.

    Raises
    ------
    GdnkitError
        Always (another ``mode`` raises one that names it).
    """
    _ext.raise_error(mode)
