"""veloxpatch's launcher bootstrap: Python imports this at start-up because the launcher put its
folder first on PYTHONPATH. It installs the shim, takes its folder back off ``sys.path`` (so the
app sees the path it would have had) and then runs the user's own ``sitecustomize``, if any.

PYTHONPATH reaches every child process, including ones that run another interpreter, which may
not have veloxpatch installed: there this file only passes on to the user's ``sitecustomize``.
The user's file runs whatever happens while installing, as it would without the launcher.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_user_sitecustomize() -> None:
    """Run the ``sitecustomize`` Python would have imported had ours not been first on the path."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


def _velox_start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        from veloxpatch.bootstrap import install

        install()
    except ModuleNotFoundError as error:
        if error.name != "veloxpatch":  # else this interpreter (a child may run another) has no veloxpatch
            raise
    finally:
        _run_user_sitecustomize()


_velox_start()
