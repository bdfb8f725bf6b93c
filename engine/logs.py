"""Log setup of `duplex serve` and its workers: text or JSON lines, and the request id on
every line logged while a request is handled. The server's --log-format rides in the config
its workers receive (engine.config.WorkerConfig.log_format), so they log the same way.

The server's middleware sets REQUEST_ID (a context variable) when a request arrives; tasks
started for the request inherit it, and a filter copies it onto each record as `req_id`.
Text lines end with ` req_id=...` when the message does not already name it; JSON lines
carry it as a field:

    {"ts": "2026-12-01T11:00:00.123Z", "level": "info", "logger": "duplex.server",
     "msg": "http method=POST ...", "req_id": "3f2a..."}
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("duplex_request_id",
                                                                        default=None)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "req_id"):
            record.req_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        req_id = getattr(record, "req_id", None)
        if req_id and f"req_id={req_id}" not in line:
            line += f" req_id={req_id}"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage(),
        }
        req_id = getattr(record, "req_id", None)
        if req_id:
            entry["req_id"] = req_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, log_format: str = "text", stream=None) -> logging.Handler:
    """Duplex's handler on the root logger (replacing one set up before; handlers others
    installed, e.g. pytest's, stay)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    handler.is_duplex = True
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "is_duplex", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn lines become records in the same format
    return handler
