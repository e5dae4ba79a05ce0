"""Reading CIFAR's python batch files without running their code.

A CIFAR batch is a pickled dict of bytes keys, lists of ints or bytes, and numpy arrays. Plain
``pickle.load`` would call any function a file names, so a crafted ``data_batch_1`` could run a
shell command: :func:`read_cifar_pickle` resolves only the globals such a file holds.
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import numpy as np

try:  # numpy 2 moved the reconstruction helpers; pickles name either module
    from numpy._core.multiarray import _reconstruct
    from numpy._core.numeric import _frombuffer
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct
    from numpy.core.numeric import _frombuffer


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ALLOWED`; ``name`` is ``module.qualname``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"its pickle would call {name}")
        self.name = name


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as a protocol-2 pickle uses it for ``bytes`` (``(text, 'latin1')``);
    any other encoding is refused, so the codec registry is never searched for a name a file
    chose."""
    if encoding not in ("latin1", "latin-1"):
        raise RefusedGlobal(f"_codecs.encode(..., {encoding!r})")
    return codecs.encode(text, "latin1")


# Every global a CIFAR batch written by the authors (Python 2, numpy 1) or by numpy 1/2 under
# pickle protocols 2-5 names: array and dtype reconstruction, and bytes under protocol 2.
ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_bytes,
}


class CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds only dicts, lists, tuples, str/bytes, numbers and numpy arrays:
    :meth:`find_class` answers from :data:`ALLOWED` and raises :class:`RefusedGlobal` for any
    other global, so no function a file names is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise RefusedGlobal(f"{module}.{name}")
        return found


def read_cifar_pickle(path: Path) -> Any:
    """The object pickled in ``path``, read as the CIFAR authors' Python 2 files need
    (``encoding='bytes'``: their str keys become bytes). Raises :class:`RefusedGlobal` for a
    file naming any global but numpy's array reconstruction, and what ``pickle`` raises for a
    truncated or malformed file (UnpicklingError, EOFError, ValueError, ...)."""
    with path.open("rb") as f:
        return CifarUnpickler(f, encoding="bytes").load()
