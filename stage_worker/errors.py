"""Errors a user can act on. Their message is one line that names the file or thing at fault."""


class ModelLoadError(Exception):
    """A model folder or file cannot be served (missing file, unsupported architecture, corrupt data)."""


class NoRoomError(ModelLoadError):
    """The worker's disk, or its --cache-limit, cannot hold the weights of the layers it was given."""
