class ModelLoadError(Exception):
    """A model could not be opened, converted or verified; the message says why and what to do."""
