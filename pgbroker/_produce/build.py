"""Celery protocol-2 messages for :func:`pgbroker.enqueue`, made as ``apply_async`` makes them.

:func:`build` is ``Task.apply_async`` / ``Celery.send_task`` up to the broker: the task's
execution options, the router, parent and root ids, Celery's own ``as_task_v2``, the task's
serializer and compression; then the transport's own message -> row conversion
(:func:`pgbroker._model.message.message_to_job`), so every publish check is the transport's.
:class:`Templates` makes most of an :func:`pgbroker.enqueue_many` batch from the first message of
each kind (re-implementing ``saferepr`` and ``uuid4`` where provably identical, for speed).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from json.encoder import encode_basestring_ascii as _json_string  # json.dumps of a str
from typing import Any

import uuid6
from celery import current_app
from celery.app.amqp import AMQP
from celery.app.routes import MapRoute, Router
from celery.utils.saferepr import saferepr
from kombu.compression import compress
from kombu.serialization import dumps, registry
from kombu.utils import json as kombu_json
from kombu.utils.uuid import uuid as task_uuid

from .._model.job import NewJob
from .._model.keys import KEY_HEADERS
from .._model.message import MAX_ID_BYTES, message_to_job
from .._model.text import ESCAPED, storable
from ..errors import MessageError
from ..settings import Settings

__all__ = ["OPTIONS", "Planned", "Templates", "app_of", "build", "check_options", "unpack"]

#: The keyword options of :func:`pgbroker.enqueue`, also accepted in
#: :func:`pgbroker.enqueue_many`'s option dicts.
OPTIONS = frozenset({"queue", "idempotency_key", "countdown", "eta", "expires", "priority",
                     "max_attempts", "headers", *KEY_HEADERS})


def app_of(app: Any, task: Any) -> Any:
    """The Celery app: ``app``, else the task's, else ``celery.current_app``."""
    if app is not None:
        return app
    task_app = getattr(task, "app", None) if not isinstance(task, str) else None
    if task_app is not None:
        return task_app
    return current_app._get_current_object()



def _task_of(app: Any, task: Any) -> tuple[str, Any]:
    """(name, task object or None) of a task object or a name."""
    if isinstance(task, str):
        if not task:
            raise MessageError("the task name is empty")
        return task, app._tasks.get(task)  # like send_task: no finalize for a remote name
    name = getattr(task, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"task must be a Celery task or a task name, not {task!r}")
    return name, task


def build(app: Any, settings: Settings, task: Any, args: Any, kwargs: Any,
           options: dict[str, Any], recipe: dict[str, Any] | None = None) -> NewJob:
    """A Celery protocol-2 message for ``task``, as the row the transport would write for it.

    Mirrors ``Task.apply_async`` / ``Celery.send_task``: the task's execution options, the
    router, parent and root ids, ``as_task_v2`` for headers and body, the task's serializer and
    compression. Only ``expires`` is carried by its header alone (no AMQP ``expiration``).

    ``recipe``, if given, receives what :class:`_Template` needs to make more messages like this
    one: the serializer, the compression, the body's embed part, the argument check.
    """
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(f"unknown enqueue option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
    name, task_type = _task_of(app, task)
    args = () if args is None else args
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"task args must be a list or tuple, not {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"task kwargs must be a mapping, not {type(kwargs).__name__}")
    check_options(options)
    check_arguments = getattr(task_type, "__header__", None)
    if check_arguments is not None and getattr(task_type, "typing", False):
        check_arguments(*args, **kwargs)  # TypeError for arguments the task cannot take
    exec_options: dict[str, Any] = {}
    if task_type is not None and hasattr(task_type, "_get_exec_options"):
        exec_options = {k: v for k, v in task_type._get_exec_options().items() if v is not None}
    explicit = {k: options.get(k) for k in ("queue", "priority", "expires")}
    exec_options.update({k: v for k, v in explicit.items() if v is not None})
    route = app.amqp.router.route(exec_options, name, args, kwargs, task_type)
    queue = route.get("queue")
    if queue is None:
        raise MessageError(f"the route of task {name!r} names no queue ({route!r}); "
                           "pgbroker.enqueue writes to a queue, not through an exchange")
    queue_name = queue if isinstance(queue, str) else queue.name
    headers = dict(options.get("headers") or {})
    for key in ("idempotency_key", "max_attempts", *KEY_HEADERS):
        value = options.get(key)
        if value is None:
            continue
        if headers.get(key, value) != value:
            raise MessageError(f"{key} is given twice with different values: {value!r} and "
                               f"headers[{key!r}] = {headers[key]!r}")
        headers[key] = value
    root_id = parent_id = None
    parent = app.current_worker_task
    if parent:
        root_id = parent.request.root_id or parent.request.id
        parent_id = parent.request.id
    task_id = task_uuid()
    ignore_result = getattr(task_type, "ignore_result", app.conf.task_ignore_result)
    try:
        message = app.amqp.as_task_v2(
            task_id, name, args, kwargs, countdown=options.get("countdown"),
            eta=options.get("eta"), expires=route.get("expires"), reply_to=app.thread_oid,
            time_limit=route.get("time_limit"), soft_time_limit=route.get("soft_time_limit"),
            root_id=root_id, parent_id=parent_id, ignore_result=ignore_result)
    except ValueError as exc:  # Celery's own check of countdown / expires
        raise MessageError(str(exc)) from exc
    message.headers.update(headers)
    serializer = route.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, body = dumps(message.body, serializer=serializer)
    compression = route.get("compression") or app.conf.task_compression
    if compression:
        body, message.headers["compression"] = compress(body, compression)
    if recipe is not None:
        recipe.update(serializer=serializer, compression=compression, embed=message.body[2],
                      check_arguments=check_arguments
                      if check_arguments is not None and getattr(task_type, "typing", False)
                      else None)
    properties = {
        **message.properties,
        "delivery_mode": 2,  # persistent: every pgbroker message is a durable row anyway
        "priority": route.get("priority") or 0,
        "body_encoding": None,
        "delivery_info": {"exchange": "", "routing_key": queue_name},
    }
    return message_to_job(settings, queue_name, {
        "body": body, "content-type": content_type, "content-encoding": content_encoding,
        "headers": message.headers, "properties": properties})


# -- enqueue_many: a batch's messages made from one real message per kind of job ----------------
#
# build costs tens of microseconds a message, most of it spent on what is the same for every
# job of a task: the router, the app's configuration, the task's execution options. For a batch,
# the first job of each kind (same app, task, queue, priority, max_attempts, with or without an
# idempotency key) is made by build, and becomes the template of the others: only what
# ``as_task_v2`` makes per job (task id, root id, argsrepr, kwargsrepr, the body) and the key are
# made again, exactly as build makes them. Whatever could make two jobs of a kind differ in more
# than that (a time, custom headers, a router that reads the arguments, another as_task_v2)
# sends the job to build.

#: Options a job may carry and still be made from its kind's template: part of the kind
#: (queue, priority, max_attempts), or one header value (idempotency_key).
_TEMPLATE_OPTIONS = frozenset({"queue", "priority", "max_attempts", "idempotency_key"})

#: Deepest nesting _plain_repr renders when ``task_repr_maxlevels`` sets no limit.
_PLAIN_REPR_LEVELS = 8

#: A message planned by _Template.plan: (template, body, content type, content encoding,
#: argsrepr, kwargsrepr, idempotency key).
Planned = tuple["_Template", bytes, str, str, str, str, "str | None"]


class Templates:
    """The templates of one :func:`enqueue_many` call, by kind of job."""

    def __init__(self) -> None:
        self._of: dict[tuple[Any, ...], _Template | None] = {}
        self._keep: list[Any] = []  # apps and tasks keyed by id(): alive as long as their key
        #: {job id: its headers and properties as jsonb binary values} for the jobs made from a
        #: template (_insert_many sends them as they are, rather than json.dumps-ing each dict)
        self.json_of: dict[uuid.UUID, tuple[bytes, bytes]] = {}

    def build(self, app: Any, settings: Settings, task: Any, args: Any, kwargs: Any,
              options: dict[str, Any]) -> NewJob | Planned:
        """What ``build(app, settings, task, args, kwargs, options)`` returns, or the same
        message planned: checked, its body and reprs made, to be finished by
        :meth:`_Template.finish` (which cannot fail) when its batch is written."""
        kind = _kind(app, task, options)
        if kind is None:
            return build(app, settings, task, args, kwargs, options)
        try:
            template = self._of[kind]
        except KeyError:
            recipe: dict[str, Any] = {}
            job = build(app, settings, task, args, kwargs, options, recipe)
            self._keep.append((app, task))
            template = self._of[kind] = _Template.make(app, settings, job, recipe)
            if template is not None:
                template.add_json(job, self.json_of)
            return job
        planned = None if template is None else template.plan(
            args, kwargs, options.get("idempotency_key"))
        return planned if planned is not None else build(
            app, settings, task, args, kwargs, options)


def _kind(app: Any, task: Any, options: dict[str, Any]) -> tuple[Any, ...] | None:
    """The key of the jobs that share a template with this one; None: build only."""
    for name, value in options.items():
        if name not in _TEMPLATE_OPTIONS and (value is not None or name not in OPTIONS):
            return None  # a per-job option (or an unknown one, which build refuses)
    queue = options.get("queue")
    priority = options.get("priority")
    max_attempts = options.get("max_attempts")
    key = options.get("idempotency_key")
    # exact types: True == 1 as a dict key, but is refused as a priority or max_attempts
    if not ((queue is None or type(queue) is str) and (priority is None or type(priority) is int)
            and (max_attempts is None or type(max_attempts) is int)
            and (key is None or type(key) is str)):
        return None
    return (id(app), task if isinstance(task, str) else id(task), queue, priority, max_attempts,
            key is not None)


class _Template:
    """One message made by build, and how to make its kind's other messages from it."""

    __slots__ = ("headers", "properties", "root_is_id", "serializer", "compression", "embed",
                 "check_arguments", "args_maxsize", "kwargs_maxsize", "maxlevels",
                 "max_message_size", "job", "headers_json", "properties_json", "encode_json")
    headers: dict[str, Any]
    properties: dict[str, Any]
    root_is_id: bool
    serializer: str
    compression: str | None
    embed: dict[str, Any]
    check_arguments: Callable[..., Any] | None
    args_maxsize: int
    kwargs_maxsize: int
    maxlevels: int | None
    max_message_size: int
    job: NewJob
    headers_json: _JsonPieces | None
    properties_json: _JsonPieces | None
    encode_json: Callable[[Any], str] | None

    @classmethod
    def make(cls, app: Any, settings: Settings, job: NewJob,
             recipe: dict[str, Any]) -> _Template | None:
        """The template of ``job``'s kind, or None if its jobs may differ in more than the
        per-job fields (then build makes every one of them)."""
        amqp = app.amqp
        router = amqp.router
        headers = job.headers
        if not (type(amqp).as_task_v2 is AMQP.as_task_v2 and "as_task_v2" not in vars(amqp)
                and type(router) is Router
                and all(type(route) is MapRoute for route in router.routes)  # name only
                and headers.get("eta") is None and headers.get("expires") is None
                and job.run_at is None and job.expires_at is None and not job.retries
                and "expiration" not in job.properties
                and job.task_id == headers.get("id") == job.properties.get("correlation_id")):
            return None
        self = cls()
        self.job = job
        self.headers = dict(headers)
        self.root_is_id = headers.get("root_id") == job.task_id
        self.properties = dict(job.properties)
        self.serializer = recipe["serializer"]
        self.compression = recipe["compression"]
        self.embed = recipe["embed"]
        self.encode_json = _json_encoder(self.serializer)
        self.check_arguments = recipe["check_arguments"]
        self.args_maxsize = amqp.argsrepr_maxsize
        self.kwargs_maxsize = amqp.kwargsrepr_maxsize
        self.maxlevels = app.conf.task_repr_maxlevels
        self.max_message_size = settings.max_message_size
        per_job = ["id", "argsrepr", "kwargsrepr"]
        if self.root_is_id:
            per_job.append("root_id")
        if job.idempotency_key is not None:
            per_job.append("idempotency_key")
        self.headers_json = _JsonPieces.make(self.headers, per_job)
        self.properties_json = _JsonPieces.make(self.properties, ["correlation_id"])
        return self

    def plan(self, args: Any, kwargs: Any, key: str | None) -> Planned | None:
        """This kind's message for these arguments, all but what :meth:`finish` adds; None
        where only build can tell (an error, an unusual argument).

        Everything read from the arguments is read here, when the caller hands them over."""
        if args is None:
            args = ()
        elif type(args) is not tuple and type(args) is not list:
            return None
        if kwargs is None:
            kwargs = {}
        elif type(kwargs) is not dict:
            return None
        if self.check_arguments is not None:
            self.check_arguments(*args, **kwargs)  # TypeError for arguments the task cannot take
        # as in as_task_v2
        args = args or ()
        kwargs = kwargs or {}
        argsrepr = _plain_repr(args, self.args_maxsize, self.maxlevels)
        kwargsrepr = _plain_repr(kwargs, self.kwargs_maxsize, self.maxlevels)
        try:
            if argsrepr is None:
                argsrepr = saferepr(args, self.args_maxsize, maxlevels=self.maxlevels)
            if kwargsrepr is None:
                kwargsrepr = saferepr(kwargs, self.kwargs_maxsize, maxlevels=self.maxlevels)
        except Exception:  # noqa: BLE001 - e.g. an int too long for str(): build's MessageError
            return None
        if not (_plain(argsrepr) and _plain(kwargsrepr)) or (
                key is not None and not (type(key) is str and _plain(key)
                                         and len(key.encode()) <= MAX_ID_BYTES)):
            return None  # escaped or refused by build (message_to_job)
        body: Any  # str or bytes, or whatever another serializer returns (refused below)
        if self.encode_json is not None:
            try:
                body = self.encode_json((args, kwargs, self.embed))
            except Exception:  # noqa: BLE001 - build raises kombu's EncodeError for it
                return None
            content_type, content_encoding = "application/json", "utf-8"
        else:
            content_type, content_encoding, body = dumps((args, kwargs, self.embed),
                                                         serializer=self.serializer)
        if self.compression:
            body = compress(body, self.compression)[0]
        if isinstance(body, str):
            body = body.encode("utf-8")
        elif type(body) is not bytes:
            return None
        if len(body) > self.max_message_size:
            return None  # build raises message_to_job's error for it
        return (self, body, content_type, content_encoding, argsrepr, kwargsrepr, key)

    def finish(self, planned: Planned, json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> NewJob:
        """The message :meth:`plan` planned (what build would return, but for the random
        ids); its jsonb values go to ``json_of``."""
        _, body, content_type, content_encoding, argsrepr, kwargsrepr, key = planned
        task_id = _task_id()
        headers = self.headers.copy()
        headers["id"] = task_id
        if self.root_is_id:
            headers["root_id"] = task_id
        headers["argsrepr"] = argsrepr
        headers["kwargsrepr"] = kwargsrepr
        if key is not None:
            headers["idempotency_key"] = key
        properties = self.properties.copy()
        properties["correlation_id"] = task_id
        job = self.job
        made = NewJob(
            id=uuid6.uuid7(), queue=job.queue, body=body, content_type=content_type,
            content_encoding=content_encoding, headers=headers, properties=properties,
            exchange=job.exchange, routing_key=job.routing_key, task=job.task, task_id=task_id,
            retries=0, priority=job.priority, max_attempts=job.max_attempts, run_at=None,
            expires_at=None, idempotency_key=key)
        self.add_json(made, json_of)
        return made

    def add_json(self, job: NewJob, json_of: dict[uuid.UUID, tuple[bytes, bytes]]) -> None:
        """Put ``job``'s (one of this kind's) headers and properties as jsonb in ``json_of``
        (not for a job whose own values had to be escaped: its dicts are sent then)."""
        if (self.headers_json is not None and self.properties_json is not None
                and all(_plain(job.headers[key]) for key in self.headers_json.keys)
                and _plain(job.properties["correlation_id"])):
            json_of[job.id] = (self.headers_json.fill(job.headers),
                               self.properties_json.fill(job.properties))


class _JsonPieces:
    """A dict's JSON text cut around the values of some of its keys, all strings: the JSON of
    a copy that differs only in those values is the pieces joined with their JSON strings.

    jsonb keeps no text: what PostgreSQL stores is the same as for ``json.dumps`` of the copy.
    """

    __slots__ = ("format", "keys")
    format: str
    keys: list[str]

    _MARK = "\x00pgbroker:{}\x00"

    @classmethod
    def make(cls, value: dict[str, Any], keys: list[str]) -> _JsonPieces | None:
        """None if ``value`` has no JSON text of its own (psycopg's dumper then decides)."""
        probe = dict(value)
        for index, key in enumerate(keys):
            probe[key] = cls._MARK.format(index)
        try:
            text = json.dumps(probe)
        except (TypeError, ValueError):
            return None
        found = []
        for index, key in enumerate(keys):
            mark = json.dumps(cls._MARK.format(index))
            at = text.find(mark)
            if at < 0 or text.find(mark, at + 1) >= 0:
                return None
            found.append((at, len(mark), key))
        self = cls()
        pieces, self.keys, start = [], [], 0
        for at, length, key in sorted(found):
            pieces.append(text[start:at].replace("%", "%%"))
            self.keys.append(key)
            start = at + length
        pieces.append(text[start:].replace("%", "%%"))
        if not all(_plain_json(piece) for piece in pieces):
            return None  # something in it needs escaping (pgbroker._model.text): jsonb_dumps then
        self.format = "\x01" + "%s".join(pieces)
        return self

    def fill(self, value: dict[str, Any]) -> bytes:
        """The jsonb binary value (version byte 1, then the text) of ``value``."""
        return (self.format % tuple([_json_string(value[key]) for key in self.keys])).encode()


def _plain(text: Any) -> bool:
    """A string stored as it is, not escaped (pgbroker._model.text)."""
    return type(text) is str and storable(text) and not text.startswith(ESCAPED)


def _plain_json(text: str) -> bool:
    """JSON text with no string in it that may need escaping (as pgbroker._model.text.jsonb_dumps
    tells them: no \\u0000, no \\udXXX, no ESCAPED)."""
    return "\\u0000" not in text and "\\ud" not in text and ESCAPED not in text


def _json_encoder(serializer: Any) -> Any:
    """For kombu's own json serializer, the ``encode`` of a ``JSONEncoder`` kept for the batch:
    what ``dumps(data, serializer="json")`` returns as the body, without making an encoder and
    its arguments per call (``json.dumps(data, cls=JSONEncoder)`` makes one with the same
    defaults). None for any other serializer: kombu's ``dumps`` then."""
    codec = registry._encoders.get(serializer) if serializer == "json" else None
    if (codec is None or codec.encoder is not kombu_json.dumps
            or (codec.content_type, codec.content_encoding) != ("application/json", "utf-8")
            or kombu_json.dumps.__defaults__ != (json.dumps, kombu_json.JSONEncoder, None)):
        return None
    return kombu_json.JSONEncoder().encode


def _task_id() -> str:
    """What kombu's ``uuid()`` makes, ``str(uuid.uuid4())``, without the UUID object."""
    data = bytearray(os.urandom(16))
    data[6] = data[6] & 0x0F | 0x40  # version 4
    data[8] = data[8] & 0x3F | 0x80  # variant RFC 4122
    hex_ = data.hex()
    return f"{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:]}"


def _plain_repr(value: Any, maxsize: Any, maxlevels: Any) -> str | None:
    """``saferepr(value, maxsize, maxlevels=maxlevels)`` where it is provably the same string,
    else None (then call saferepr).

    Only None, bool, int, float, str and tuples, lists and dicts (with str keys) of them, of the
    exact types, nested less deep than ``maxlevels``: saferepr writes those as ``str()`` of a
    number, a string in single quotes with only ``'`` escaped, the containers as ``repr`` does;
    and it cuts nothing from a result shorter than ``maxsize``.
    """
    if type(maxlevels) is not int or not (maxsize is None or type(maxsize) is int):
        return None
    parts: list[str] = []
    try:
        if not _plain_repr_parts(value, parts, 0, maxlevels or _PLAIN_REPR_LEVELS):
            return None
    except ValueError:  # an int too long for str(): saferepr's own error, or not
        return None
    text = "".join(parts)
    if maxsize is not None and len(text) >= maxsize:
        return None
    return text


def _plain_repr_parts(value: Any, out: list[str], level: int, maxlevels: int) -> bool:
    kind = type(value)
    if kind is str:
        out.append("'" + value.replace("'", "\\'") + "'")
    elif kind is int or kind is float or kind is bool:
        out.append(str(value))
    elif value is None:
        out.append("None")
    elif kind is tuple or kind is list or kind is dict:
        if level >= maxlevels:  # saferepr writes "[...]"
            return False
        if kind is dict:
            out.append("{")
            first = True
            for key, item in value.items():
                if type(key) is not str:
                    return False
                if not first:
                    out.append(", ")
                first = False
                out.append("'" + key.replace("'", "\\'") + "': ")
                if not _plain_repr_parts(item, out, level + 1, maxlevels):
                    return False
            out.append("}")
            return True
        out.append("(" if kind is tuple else "[")
        for index, item in enumerate(value):
            if index:
                out.append(", ")
            if not _plain_repr_parts(item, out, level + 1, maxlevels):
                return False
        out.append((",)" if len(value) == 1 else ")") if kind is tuple else "]")
    else:
        return False
    return True


def check_options(options: dict[str, Any]) -> None:
    """Refuse option values Celery would accept silently or fail on obscurely."""
    priority = options.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                 or not 0 <= priority <= 255):
        raise MessageError(f"priority must be an integer from 0 to 255, not {priority!r}")
    for key in ("eta", "expires"):
        value = options.get(key)
        if key == "expires" and isinstance(value, (int, float)) and not isinstance(value, bool):
            continue
        if value is not None and not isinstance(value, (datetime, str)):
            raise MessageError(f"{key} must be a datetime or an ISO 8601 string"
                               f"{' or seconds' if key == 'expires' else ''}, not {value!r}")
    countdown = options.get("countdown")
    if countdown is not None and (not isinstance(countdown, (int, float))
                                  or isinstance(countdown, bool)):
        raise MessageError(f"countdown must be a number of seconds, not {countdown!r}")
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, Mapping):
        raise MessageError(f"headers must be a mapping, not {type(headers).__name__}")


def unpack(index: int, item: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    if not (type(item) is tuple or type(item) is list) and (  # (the ABC check is slow)
            isinstance(item, (str, bytes)) or not isinstance(item, Sequence)) or not (
            1 <= len(item) <= 4):
        raise TypeError(f"enqueue_many item {index} must be (task, args, kwargs, options) with "
                        f"the trailing parts optional, not {item!r}")
    # the parts left out take their defaults: args (), kwargs None, options None (the ignore:
    # mypy refuses a * of the narrowed type, tuple | list | Any, which is iterable)
    task, args, kwargs, options = [*item, *[(), None, None][len(item) - 1:]]  # type: ignore[misc]
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"enqueue_many item {index}: options must be a dict, not {options!r}")
    return task, args, kwargs, options or {}
