"""veloxpatch's launcher bootstrap: Python imports this at start-up because the launcher put its
folder first on PYTHONPATH. It installs the shim, takes its folder back off ``sys.path`` (so the
app sees the path it would have had) and then runs the user's own ``sitecustomize``, if any."""

import importlib.machinery
import importlib.util
import os
import sys


def _velox_start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from veloxpatch.bootstrap import install

    install()
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_velox_start()
