"""The cluster token: the shared secret the cluster's TLS is keyed by (cluster_tls.py).

It comes from --cluster-token, the METAL_CLUSTER_TOKEN environment variable, or the token file
that `metal-cluster token` creates. The file's place is $METAL_CLUSTER_TOKEN_FILE when set (the
config file's `token_file` sets it), else ~/.config/metal-cluster/token. It never goes into mDNS
TXT records or logs.
"""

import os
import secrets
from pathlib import Path

TOKEN_ENV = "METAL_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "METAL_CLUSTER_TOKEN_FILE"


def token_file() -> Path:
    if os.environ.get(TOKEN_FILE_ENV):
        return Path(os.environ[TOKEN_FILE_ENV]).expanduser()
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(root) / "metal-cluster" / "token"


def resolve_token(explicit: str | None = None) -> str | None:
    """The flag, else the environment, else the token file; None when none is set."""
    if explicit:
        return explicit
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = token_file()
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def create_token_file() -> tuple[Path, str]:
    """The token file's path and token, creating it (mode 600) when it does not exist."""
    path = token_file()
    if path.is_file() and path.read_text().strip():
        return path, path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path, token
