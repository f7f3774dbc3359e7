"""mlx_lm's server: settings per request (what a request may carry, and how: docs/settings.md, "Per request, on
mlx_lm's server"). A bad one is mlx_lm's own HTTP 400, and the server keeps serving.

The settings travel with the request from the HTTP handler to the generation thread or the batch it joins
(docs/DESIGN.md, "One server request"; where batches are mlx_lm's own, a request whose settings are not the
process's is served one at a time). The server's prompt cache is keyed by the settings too, so a prompt cached under
one setting is never reused under another, and the answer's ``usage`` says what the request's KV holds
(:meth:`Ticket.usage`).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import wrapt

from .. import stats
from ..config import CORE_SETTINGS, PROCESS_WIDE, ConfigError, Setting, VeloxConfig, request_settings
from ..log import log
from . import compat
from .batched import batching_on
from .state import STATE, hand_to_batch, in_force, same_as_process, served, serving, to_batch

FIELD = "velox"
"""The JSON field of a request's settings."""

HEADER = "x-velox-"
"""The prefix of a setting's header (any case): ``X-Velox-Budget``."""

CARRIED = (f"a request may carry {', '.join(s.key for s in CORE_SETTINGS if s.key not in PROCESS_WIDE)} and the "
           "methods' knobs (e.g. snapkv_kernel; `veloxpatch methods` lists them)")
"""What a request may carry, in words: the core settings by key, the knobs by kind."""

WAIT_S = 10.0
"""How long an answer waits for its request's measurement (a generation thread that died never gives it)."""


class RequestError(ValueError):
    """A request's settings that cannot be served: mlx_lm answers a ValueError from its parameter checks with 400."""


class Ticket:
    """One request's settings, from its handler to its generation thread and back with what its cache list holds."""

    def __init__(self, config: VeloxConfig) -> None:
        self.config = config
        self.started = False
        self.prompt_tokens: int | None = None  # set when a batch serves it (:meth:`batched`)
        self.held: dict[str, int] | None = None
        self.done = threading.Event()  # set once its list is measured, or its generation over

    def __reduce__(self) -> tuple[type[Ticket], tuple[VeloxConfig]]:
        """Pickled (a distributed server shares a request with its other ranks), its config alone."""
        return Ticket, (self.config,)

    def __deepcopy__(self, memo: dict[int, Any]) -> Ticket:
        """Itself: the copies of a batched request's cache list it rides on must report to the one request."""
        return self

    def batched(self, prompt_tokens: int) -> None:
        """A batch serves the request, whose prompt is ``prompt_tokens`` long: its answer waits for the list the
        server stores once it holds the whole prompt."""
        self.started, self.prompt_tokens = True, prompt_tokens

    def usage(self) -> dict[str, Any]:
        """``usage["velox"]`` of the request's answer, once its list is measured (waiting :data:`WAIT_S` at most)."""
        if self.started and not self.done.wait(WAIT_S):
            log.warning("the KV usage of a request was not measured within %.0f s", WAIT_S)
        held: dict[str, Any] = self.held or dict.fromkeys(stats.HELD)
        seen = held["rows_seen"]
        share = round(held["rows_kept"] / seen, 4) if seen else (None if seen is None else 1.0)
        return {"kv": self.config.kv, "budget": str(self.config.budget) if self.config.enabled else None,
                **held, "share_kept": share}


def settings_of(body: Any, headers: Any, base: VeloxConfig) -> VeloxConfig:
    """The settings a request asks for (its body's :data:`FIELD`, its :data:`HEADER` headers) over ``base``;
    :class:`RequestError` naming the field, the value and what is allowed where one cannot be served."""
    field = body.get(FIELD) if isinstance(body, dict) else None
    if field is not None and not isinstance(field, dict):
        raise RequestError(f'"{FIELD}" must be a JSON object of settings (e.g. {{"kv": "snapkv", "budget": "25%"}}), '
                           f"not {field!r}")
    given = [(str(key), f"{FIELD}.{key}", value) for key, value in (field or {}).items()]
    given += [(name[len(HEADER):].lower().replace("-", "_"), f"header {name}", value)
              for name, value in (headers.items() if headers is not None else []) if name.lower().startswith(HEADER)]
    if not given:
        return base
    allowed = request_settings()
    parsed: dict[str, tuple[str, Any, Any]] = {}  # key -> (where, as given, parsed)
    for key, where, value in given:
        value_parsed = _parsed(key, where, value, allowed)
        if key in parsed and parsed[key][2] != value_parsed:
            raise RequestError(f"{parsed[key][0]}={parsed[key][1]!r} and {where}={value!r} disagree")
        parsed.setdefault(key, (where, value, value_parsed))
    try:
        return base.replace(**{key: value_parsed for key, (_, _, value_parsed) in parsed.items()})  # knobs by key too
    except ConfigError as error:
        raise RequestError(f"{FIELD}: {error}") from None


def _parsed(key: str, where: str, value: Any, allowed: Mapping[str, Setting]) -> Any:
    """``value`` of setting ``key`` as the environment's would be parsed, or a :class:`RequestError`."""
    if key in PROCESS_WIDE:
        raise RequestError(f"{where}: VELOX_{key.upper()} is the server process's setting, not a request's "
                           f"({PROCESS_WIDE[key]}); {CARRIED}")
    setting = allowed.get(key)
    if setting is None:
        close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RequestError(f"{where}: {key!r} is not a setting{hint}; {CARRIED}")
    if isinstance(value, (dict, list)) or value is None:
        raise RequestError(f"{where}={value!r} is not allowed: expected {setting.allowed_text}, as a string, a "
                           "number or a boolean")
    try:
        return setting.convert(value)
    except ConfigError as error:
        raise RequestError(f"{where}: {error}") from None


# --------------------------------------------------------------------- the handler's thread
@wrapt.decorator
def validate_model_parameters(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """mlx_lm's checks, then the request's settings from the JSON body ``do_POST`` parsed into ``body`` and the
    headers (:class:`RequestError`: mlx_lm answers 400); the ticket rides on the handler, replaced at each request
    (a kept-alive connection reuses the handler)."""
    compat.carry(instance, None)
    result = wrapped(*args, **kwargs)
    base = STATE.config
    if base is not None:
        compat.carry(instance, Ticket(settings_of(getattr(instance, "body", None), getattr(instance, "headers", None),
                                                  base)))
    return result


def _hand_on(holder: Any, to: Any) -> None:
    """The ticket ``holder`` carries (if any) goes with ``to``, the next of mlx_lm's objects of the request."""
    ticket = compat.carried(holder)
    if ticket is not None and to is not None:
        compat.carry(to, ticket)


@wrapt.decorator
def handle_completion(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``APIHandler.handle_completion(request, stop_words)``: the handler's ticket goes on with ``request``."""
    _hand_on(instance, args[0] if args else kwargs.get("request"))
    return wrapped(*args, **kwargs)


@wrapt.decorator
def generate(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``ResponseGenerator.generate(request, generation_args, ...)``: the request's ticket goes with the arguments,
    which reach the generation thread (and, pickled, a distributed server's other ranks)."""
    _hand_on(args[0] if args else kwargs.get("request"),
             args[1] if len(args) > 1 else kwargs.get("generation_args"))
    return wrapped(*args, **kwargs)


@wrapt.decorator
def with_usage(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``generate_response`` and ``completion_usage_response``: an answer with ``usage`` (a whole one, or a stream's
    usage chunk) says what the request's KV holds."""
    response = wrapped(*args, **kwargs)
    ticket = compat.carried(instance)
    if ticket is not None and isinstance(response, dict) and isinstance(response.get("usage"), dict):
        response["usage"][FIELD] = ticket.usage()
    return response


# --------------------------------------------------------------------- the generation thread
@wrapt.decorator
def is_batchable(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """mlx_lm's answer; a request whose settings are not the process's also needs batches of ours (which take any
    sequence's caches). A batchable request's ticket goes to the batch (:func:`.state.hand_to_batch`)."""
    ticket = compat.carried(args[0] if args else kwargs.get("args"))
    batchable = wrapped(*args, **kwargs) and (ticket is None or same_as_process(ticket.config) or batching_on())
    hand_to_batch(ticket if batchable else None)
    return batchable


@wrapt.decorator
def serve_single(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_serve_single((queue, request, arguments), ...)`` with the request's settings in force on this thread."""
    request = args[0] if args else kwargs.get("request")
    ticket = compat.carried(request[compat.ARGUMENTS_AT]) if isinstance(request, tuple) else None
    if ticket is None:
        return wrapped(*args, **kwargs)
    ticket.started = True
    try:
        with serving(ticket.config, ticket):
            return wrapped(*args, **kwargs)
    finally:
        ticket.done.set()


def _batched_ticket(caches: Any) -> Ticket | None:
    """The ticket a batched request's list carries (:mod:`.batched`: on the first cache the batch held)."""
    tickets = (compat.carried(cache) for cache in (caches if isinstance(caches, list) else []))
    return next((ticket for ticket in tickets if isinstance(ticket, Ticket)), None)


def _keyed(wrapped: Callable, args: tuple, kwargs: dict, ticket: Ticket | None) -> Any:
    """``wrapped`` (an ``LRUPromptCache`` method taking ``model`` first) called with the prompt cache's key for the
    model under ``ticket``'s settings, else those in force, in place of the model."""
    config = ticket.config if ticket is not None else in_force()
    model = args[0] if args else kwargs.pop("model")
    return wrapped((model, None if config is None else config.cache_settings()), *args[1:], **kwargs)


@wrapt.decorator
def fetch_nearest_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``LRUPromptCache.fetch_nearest_cache(model, tokens)``: only lists made under the settings of the request
    about to be served (alone: in force; batched: handed to the batch)."""
    return _keyed(wrapped, args, dict(kwargs), None if served() is not None else to_batch())


@wrapt.decorator
def insert_cache(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``LRUPromptCache.insert_cache(model, tokens, prompt_cache)``: kept under the settings in force, and measured
    for the usage of its request (alone: the one served; batched: the one its list carries, once whole)."""
    caches = args[2] if len(args) > 2 else kwargs.get("prompt_cache")
    tokens = args[1] if len(args) > 1 else kwargs.get("tokens")
    alone = served()
    batched = _batched_ticket(caches) if alone is None else None
    # the server also stores a batched request's list at the end of each segment of its prompt
    whole = batched is not None and tokens is not None and len(tokens) >= (batched.prompt_tokens or 0)
    ticket = alone or (batched if whole else None)
    if ticket is not None and isinstance(caches, list):
        try:
            ticket.held = stats.held(caches)
        except Exception as error:  # a measurement must never cost the answer
            log.warning("measuring a request's KV cache failed (%s: %s)", type(error).__name__, error)
        if ticket.prompt_tokens is not None:
            ticket.done.set()
    return _keyed(wrapped, args, dict(kwargs), batched)
