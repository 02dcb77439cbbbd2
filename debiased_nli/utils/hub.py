"""Every call this tool makes to the Hugging Face Hub, bounded in time, with one-line errors.

A Hub that accepts the connection and never answers, or answers a byte a second, must not hang a command:
every request has a timeout (``DEBIASED_NLI_HUB_TIMEOUT`` seconds, default 60; ``huggingface_hub`` retries
timed-out requests with back-off), and a command's Hub work as a whole has a deadline
(``DEBIASED_NLI_HUB_DEADLINE``, default 3600 s): no request starts after it, and the work runs in a worker
thread that is given up at the deadline, whatever the server does. :func:`hub_call` is that; ``push``,
``push --diff-against``, ``diff ORG/NAME@REV``, ``train --push-to``, ``evaluate --push-to`` and ``compare report
--push-to`` all go
through it. Timeouts, the deadline, unreachable hosts, offline mode and refusals by the Hub are one-line
:class:`~.errors.ConfigError` s, and so is a setting that is not a finite number of seconds in range.
"""
from __future__ import annotations

import contextlib
import re
import time
from typing import Any, Iterator

from .errors import ConfigError, excerpt

TIMEOUT_ENV, DEADLINE_ENV = "DEBIASED_NLI_HUB_TIMEOUT", "DEBIASED_NLI_HUB_DEADLINE"


def env_seconds(env: str, default: float) -> float:
    """A positive, finite number of seconds from ``env`` (``default`` when unset), at most a week
    (:data:`~.environment.SETTINGS`: longer is no deadline at all, and beyond what a thread's wait accepts); a
    one-line error otherwise (``inf``, ``1e12``, ``-5``, ``lots``)."""
    from .environment import setting

    return setting(env, default)


class HubDeadlineExceeded(ConfigError):
    """A command's Hub work ran past its total deadline (checked before each request)."""


def _refuse_abandoned(request) -> None:
    """A request hook: a worker given up at its deadline starts no request any more. (Its retries would go on
    otherwise, and ``huggingface_hub`` closes the shared client after a failed connection: the client of the
    next command in the same process.)"""
    import threading

    if getattr(threading.current_thread(), "given_up", False):  # set by within_deadline
        raise HubDeadlineExceeded(f"a Hub request to {request.url.host} after its command's deadline was refused")


def _guarded(factory):
    """``factory`` with :func:`_refuse_abandoned` among its clients' request hooks (once)."""
    if getattr(factory, "refuses_abandoned", False):
        return factory

    def make():
        client = factory()
        client.event_hooks["request"] = [_refuse_abandoned, *client.event_hooks["request"]]
        return client

    make.refuses_abandoned = True
    return make


@contextlib.contextmanager
def hub_timeouts(timeout: float, deadline: float) -> Iterator[None]:
    """Every ``huggingface_hub`` request in the block times out after ``timeout`` seconds, and none
    starts after ``deadline`` seconds: a Hub that never answers ends the work in bounded time."""
    try:
        from huggingface_hub.utils import _http
        set_factory = _http.set_client_factory
    except (ImportError, AttributeError):  # an older huggingface_hub (requests): its own default timeouts
        yield
        return
    previous = _guarded(getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory))
    end = time.monotonic() + deadline

    def check_deadline(request) -> None:
        if time.monotonic() > end:
            raise HubDeadlineExceeded(f"the Hub at {request.url.host} was to be reached past the deadline of "
                                      f"{deadline:g} s (set {DEADLINE_ENV} for a longer one)")

    def factory():
        client = previous()
        client.timeout = _http.httpx2.Timeout(timeout)
        client.event_hooks["request"] = [check_deadline, *client.event_hooks["request"]]
        return client

    factory.refuses_abandoned = True  # made by `previous`, which is guarded
    set_factory(factory)
    try:
        yield
    except HubDeadlineExceeded:
        # a worker given up at the deadline may still be reading through the shared client: closing it under the
        # worker (what set_client_factory does) could close a socket number a later connection reuses; the client
        # is left to the worker, which starts no new request (_refuse_abandoned), and the next call gets a new one
        with _http._CLIENT_LOCK:
            _http._GLOBAL_CLIENT = None
            _http._GLOBAL_CLIENT_FACTORY = previous
        raise
    except BaseException:
        set_factory(previous)
        raise
    else:
        set_factory(previous)


def within_deadline(work, deadline: float, endpoint: str, what: str = "the push"):
    """``work()``, run in a worker thread that is given up after ``deadline`` seconds: its result, or its
    exception, or a :class:`HubDeadlineExceeded`. The worker is a daemon thread: it cannot keep the
    process alive, and it starts no new request once the deadline has passed (:func:`hub_timeouts`)."""
    import threading

    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = work()
        except BaseException as err:  # handed to the caller's thread
            done["error"] = err

    worker = threading.Thread(target=run, name="debiased-nli-hub", daemon=True)
    worker.start()
    worker.join(deadline)
    if worker.is_alive():
        worker.given_up = True  # it starts no request any more (_refuse_abandoned)
        host = re.sub(r"^[a-z]+://", "", endpoint).split("/")[0]
        raise HubDeadlineExceeded(f"{what} ({host}) ran past its deadline of {deadline:g} s and was given up "
                                  f"(set {DEADLINE_ENV} for a longer one); a request it had started may still "
                                  f"reach the Hub: check the repo before trying again")
    if "error" in done:
        raise done["error"]
    return done["result"]


def hub_error(err: Exception, endpoint: str, timeout: float, what: str = "the push") -> ConfigError | None:
    """A one-line error for a failed Hub call (None: not a network/Hub error); ``what`` the Hub refused."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return ConfigError(f"{what} needs the Hub, and offline mode is on (HF_HUB_OFFLINE is set); unset it to "
                           f"reach the Hub")
    try:
        from huggingface_hub.utils._http import httpx2 as httpx
    except ImportError:
        httpx = None
    if httpx is not None and isinstance(err, httpx.TimeoutException):
        return ConfigError(f"the Hub at {endpoint} did not answer within {timeout:g} s (after retries); check the "
                           f"network or the endpoint, or set {TIMEOUT_ENV} for a longer timeout")
    if httpx is not None and isinstance(err, (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError)):
        return ConfigError(f"cannot reach the Hub at {endpoint}: {type(err).__name__}: {err}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ConfigError(f"the Hub at {endpoint} refused {what} (HTTP {status}): {first}")
    return None


def hub_call(work, *, what: str, endpoint: str | None = None):
    """``work()`` for one command's traffic with the Hub (a push, a download, a model card): every request
    inside it times out after ``$DEBIASED_NLI_HUB_TIMEOUT`` seconds and the whole call ends within
    ``$DEBIASED_NLI_HUB_DEADLINE`` seconds (:func:`hub_timeouts`, :func:`within_deadline`), whatever the server
    does; a failure of the network or a refusal by the Hub is one line (:func:`hub_error`), ``what`` saying
    what was refused."""
    from huggingface_hub import constants

    endpoint = endpoint or constants.ENDPOINT
    timeout, deadline = env_seconds(TIMEOUT_ENV, 60), env_seconds(DEADLINE_ENV, 3600)
    try:
        with hub_timeouts(timeout, deadline):
            return within_deadline(work, deadline, endpoint, what)
    except ConfigError:
        raise
    except Exception as err:
        mapped = hub_error(err, endpoint, timeout, what)
        if mapped is None:
            raise
        raise mapped from err


def check_repo_id(repo_id: Any, option: str = "--repo-id") -> str:
    """``ORG/NAME``, each part a name the Hub accepts (letters, digits, ``.``, ``_``, ``-``; not ``..``)."""
    from .paths import NAME_RE

    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(NAME_RE.fullmatch(p) and ".." not in p and len(p) <= 96 for p in parts):
        raise ConfigError(f"{option} must look like ORG/NAME (letters, digits, '.', '_', '-'), got {excerpt(repo_id)}")
    return repo_id
