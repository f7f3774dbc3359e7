"""``import veloxpatch.auto`` as the first line of a script: patch mlx_lm from ``VELOX_*``.

Unlike the launcher's lazy bootstrap it patches at once: ``veloxpatch.is_patched()`` is true right after the import when
a method is configured or ``VELOX_FLOAT32`` applies. A bad value is logged and the script runs unpatched
(``VELOX_STRICT=1`` raises). ``VELOX_BLAS`` needs the launcher: a library is preloaded as a process starts
(:mod:`veloxpatch.cpu`).
"""

from .integration import patch_from_env

patch_from_env()
