"""``import veloxpatch.auto`` as the first line of a script: patch mlx_lm from ``VELOX_*``.

Unlike the launcher's lazy bootstrap it patches at once, so ``veloxpatch.is_patched()`` is true right after the import
when a method is configured or ``VELOX_FLOAT32`` applies (on the CPU backend by default). A bad value is logged and
the script runs unpatched (``VELOX_STRICT=1`` raises instead). It cannot preload OpenBLAS (``VELOX_BLAS``): a library
is preloaded when a process starts, which the launcher controls and an import does not.
"""

from .integration import patch_from_env

patch_from_env()
