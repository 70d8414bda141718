"""Structured logging: JSON lines in a pod, readable text on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from dra_driver.settings import LogFormat


def wants_json(fmt: LogFormat) -> bool:
    """JSON lines unless asked for text, or left to ``auto`` with a terminal to read them."""
    return fmt is LogFormat.JSON or (fmt is LogFormat.AUTO and not sys.stderr.isatty())


def _timestamped() -> list[structlog.typing.Processor]:
    return [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]


def error_line(message: str, fmt: LogFormat, *, exit_code: int) -> str:
    """The one line a command that cannot go on ends with: text on a terminal, a log event in a pod.

    It needs no :func:`configure` (a setting may be what is wrong), and it is one line even when
    the message quotes a multi-line error of a library, such as a YAML parser's.
    """
    text = " ".join(message.split())
    if not wants_json(fmt):
        return f"error: {text}"
    return _json_line({"event": "exiting", "error": text, "exit_code": exit_code})


def crash_line(exception: str) -> str:
    """A bug's traceback as one JSON log event, as structlog renders ``log.exception()``."""
    return _json_line({"event": "crashed", "exception": exception})


def _json_line(event: structlog.typing.EventDict) -> str:
    """``event`` with level and timestamp, rendered exactly like the daemon's JSON log lines."""
    for processor in _timestamped():
        event = processor(None, "error", event)  # type: ignore[assignment]
    line = structlog.processors.JSONRenderer()(None, "error", event)
    assert isinstance(line, str)
    return line


def configure(fmt: LogFormat, level: str) -> None:
    """Render the driver's structlog events, and the stdlib loggers of grpc/aiohttp, the same way.

    The driver's own events are rendered by structlog alone and written straight to stderr,
    with the level filter in front, so a line below the level costs nothing and one above it
    costs a quarter of a trip through the stdlib's logging (a prepare logs a line per claim).
    The libraries' stdlib records go through a stdlib handler with the same processors.
    """
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if wants_json(fmt)
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.typing.Processor] = [
        # Claim namespace/name/uid bound with structlog.contextvars reach every line of a prepare.
        structlog.contextvars.merge_contextvars,
        *_timestamped(),
    ]
    threshold = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(threshold)
    logging.captureWarnings(True)  # a library's warning is a log event too, not a stray stderr line
