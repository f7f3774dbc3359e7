"""``VELOX_FLOAT32``: models loaded by mlx_lm run their float16/bfloat16 parameters as float32.

``mlx_lm.utils.load_model`` is the one place every model is built from a folder (``load``,
``sharded_load``, the server, generate and chat all reach it), so it is the one we wrap. Quantized
layers stay quantized: their packed weights are integers; only their float scales and biases (and
norms, embeddings left dense) change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import wrapt
from mlx.utils import tree_flatten

from ..cpu import float32_wanted
from ..fallback import fall_back
from ..log import log
from .state import STATE

LOW = (mx.float16, mx.bfloat16)


def upcast(model: nn.Module) -> Counter[str]:
    """Cast every float16/bfloat16 parameter of ``model`` to float32; returns {dtype name: count}."""
    found = Counter(str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())
                    if v.dtype in LOW)
    if found:
        model.set_dtype(mx.float32, predicate=lambda dtype: dtype in LOW)
    return found


@wrapt.decorator
def load_model(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """For ``mlx_lm.utils.load_model``: the loaded model, upcast when ``VELOX_FLOAT32`` asks."""
    loaded = wrapped(*args, **kwargs)
    config = STATE.config
    if config is None or not float32_wanted(config.float32):
        return loaded
    try:
        found = upcast(loaded[0])
        if found and not kwargs.get("lazy", args[1] if len(args) > 1 else False):  # as the caller asked
            mx.eval(loaded[0].parameters())
        if found:
            log.info("VELOX_FLOAT32=%s: %s parameter(s) run as float32 (faster on the CPU backend)", config.float32,
                     ", ".join(f"{n} {dtype}" for dtype, n in sorted(found.items())))
    except Exception as error:  # the model still works in its own dtype
        fall_back("converting weights to float32", error, config, instead="the model keeps its own dtype")
    return loaded
