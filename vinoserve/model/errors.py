class ModelLoadError(Exception):
    """A model could not be opened, converted or verified; the message says why and what to do."""


def last_line(e: BaseException) -> str:
    """OpenVINO's errors carry a C++ trace; their last non-empty line says what went wrong."""
    return next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), str(e))
