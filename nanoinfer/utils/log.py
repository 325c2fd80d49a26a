"""The `nanoinfer` logger's default output, as vLLM's: INFO and up to stderr, so that start-up facts (the KV
cache's size) show without any logging set-up. NANOINFER_CONFIGURE_LOGGING=0 leaves logging to the application."""
import logging
import os
import sys


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes, not when logging was configured (as logging's own
    last-resort handler does): output redirected later, by the application or pytest, still gets the lines."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def configure_logging() -> None:
    if os.environ.get("NANOINFER_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("nanoinfer")
    if logger.handlers:  # configured already (by the application)
        return
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root logger's handlers (if the application has some) would print it twice
