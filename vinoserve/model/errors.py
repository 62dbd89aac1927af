class ModelLoadError(Exception):
    """A model could not be opened, converted or verified; the message says why and what to do."""


def last_line(e: BaseException) -> str:
    """OpenVINO's errors carry a C++ trace; their last non-empty line says what went wrong."""
    return next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), str(e))


def one_line(e: BaseException) -> str:
    """The message on one line, as a log line or a CLI error should be."""
    return " ".join(str(e).split()) or type(e).__name__
