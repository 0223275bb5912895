"""Backends: importing this package registers every backend this installation can offer.

``torch`` is always present. ``triton`` registers when the Triton package is installed (it
says through ``available()`` whether it can run here: it needs a CUDA GPU or the Triton
interpreter). ``flashinfer`` always registers and says through ``available()`` whether its
optional package is installed and the GPU is one its kernels run on. A backend that cannot
run here says why in ``moerunner info``.
"""

import importlib.util

from . import torch_native  # noqa: F401  (first: the portable backend leads every listing)

if (
    importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec(__name__ + ".triton") is not None
):
    from . import triton  # noqa: F401

from . import flashinfer  # noqa: E402, F401
