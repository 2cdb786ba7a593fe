"""The config file: what a host always uses, so its commands and its services need no flags.

`~/.config/metal-cluster/config.toml` (or `--config PATH`, or $METAL_CLUSTER_CONFIG). Top-level keys
hold what means the same to every command (token file, model, interface, memory share); a
`[command]` table holds that command's own options and wins over the top level. On the command
line, flags win over the environment, which wins over the file. Keys are the flags' names
(`gpu_memory_utilization` or `gpu-memory-utilization`). `vllm_args` in `[serve]` / `[up]` lists
extra vLLM flags, which the command line's own vLLM flags follow (and so override).

A mistake in the file is one line naming the file, the key and the fix: a typo must not silently
leave a service running with defaults.
"""

import difflib
import os
import tomllib
from pathlib import Path

CONFIG_ENV = "METAL_CLUSTER_CONFIG"
# Keys that mean the same wherever they apply. `port` or `host` do not (the API's port for `up`,
# the gRPC port for `worker`), so they belong in a command's table.
SHARED_KEYS = ("token_file", "model", "interface", "gpu_memory_utilization", "url")
PATH_KEYS = ("token_file", "model")  # "~" is the user's home, as in a shell
VLLM_ARGS = "vllm_args"
# Flags that act once rather than describe the host; a file that sets them would act at every start.
NOT_IN_FILE = ("help", "install_service", "uninstall_service", "config")
SECRET = "cluster_token"  # config files get shared and shown; the token has its own file (mode 600)


class ConfigError(ValueError):
    """One line: the file, the key, what is wrong and how to fix it."""


def default_path() -> Path:
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(root) / "metal-cluster" / "config.toml"


def read(path: Path | None) -> tuple[Path, dict]:
    """The file's path and table. A named file must exist; the default one may be absent."""
    named = path is not None
    path = Path(path).expanduser() if named else default_path()
    if not path.is_file():
        if named:
            raise ConfigError(f"{path}: no such config file (fix the --config path or ${CONFIG_ENV})")
        return path, {}
    try:
        with open(path, "rb") as f:
            return path, tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror}") from None


def defaults(path: Path, table: dict, group) -> tuple[dict, dict]:
    """click's `default_map` ({command: {param: value}}) and the settings that are not flags
    (`token_file`), checked against the commands' own parameters."""
    commands = {name: _params(cmd) for name, cmd in group.commands.items()}
    shared, settings, sections = {}, {}, {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        _refuse_secret(path, raw_key, key)
        if key in commands:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: `{raw_key}` names a command; write its options as a [{key}] table")
            sections[key] = value
        elif key == "token_file":
            settings[key] = _path(_typed(path, raw_key, value, str, "a path string"))
        elif key in SHARED_KEYS:
            if not any(key in params for params in commands.values()):
                raise ConfigError(f"{path}: `{raw_key}` is not an option of any command")
            shared[key] = value
        elif any(key in params for params in commands.values()):
            owners = ", ".join(f"[{name}]" for name, params in commands.items() if key in params)
            raise ConfigError(f"{path}: `{raw_key}` differs per command: put it in {owners}")
        else:
            raise ConfigError(f"{path}: unknown key `{raw_key}`{_near(key, [*SHARED_KEYS, *commands])} "
                              f"(top-level keys: {', '.join(SHARED_KEYS)}; "
                              f"or a table: {', '.join(f'[{n}]' for n in commands)})")

    default_map = {}
    for name, params in commands.items():
        merged = {}
        for key, value in shared.items():
            if key in params:
                merged[params[key].name] = _check(path, key, key, value, params[key])
        for raw_key, value in sections.get(name, {}).items():
            key = raw_key.replace("-", "_")
            where = f"[{name}] {raw_key}"
            _refuse_secret(path, where, key)
            if key == VLLM_ARGS and name in ("serve", "up"):
                if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                    raise ConfigError(f'{path}: {where} must be a list of strings, like ["--max-model-len", "8192"]')
                merged[key] = value
            elif key in params:
                merged[params[key].name] = _check(path, where, key, value, params[key])
            else:
                known = sorted({p.name for p in params.values()} | ({VLLM_ARGS} if name in ("serve", "up") else set()))
                raise ConfigError(f"{path}: unknown key `{raw_key}` in [{name}]{_near(key, known)} "
                                  f"(its keys: {', '.join(known)})")
        if merged:
            default_map[name] = merged
    return default_map, settings


def _refuse_secret(path: Path, where: str, key: str) -> None:
    if key == SECRET:
        raise ConfigError(f"{path}: {where}: keep the cluster token out of the config file; it belongs in "
                          f"the token file (`metal-cluster token` writes it; `token_file = ...` moves it)")


def _near(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _params(command) -> dict:
    """The command's parameters by every name the file may use: `as_json` or `json`, `mdns`."""
    names = {}
    for p in command.params:
        if p.name in NOT_IN_FILE or p.name == SECRET or getattr(p, "hidden", False):
            continue
        names[p.name] = p
        for opt in p.opts:
            if opt.startswith("--"):
                names.setdefault(opt[2:].replace("-", "_"), p)
    return names


def _kind(param) -> type:
    # newer typer runs on its own copy of click, whose parameters carry the Python annotation.
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation in (bool, int, float, str):
        return annotation
    if getattr(param, "is_flag", False):
        return bool
    name = getattr(getattr(param, "type", None), "name", "")  # plain click
    return {"boolean": bool, "integer": int, "integer range": int, "float": float, "float range": float}.get(name, str)


def _check(path: Path, where: str, key: str, value, param):
    """The value as the flag would take it, refusing TOML types the flag does not mean."""
    kind = _kind(param)
    if kind is bool:
        return _typed(path, where, value, bool, "true or false")
    if kind is int or kind is float:
        if kind is int:
            _typed(path, where, value, int, "a whole number")
        else:
            value = float(_typed(path, where, value, (int, float), "a number"))
        low, high = getattr(param, "min", None), getattr(param, "max", None)
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"from {low} to {high}" if low is not None and high is not None else (
                f"at least {low}" if low is not None else f"at most {high}")
            raise ConfigError(f"{path}: {where} must be {span}, not {value}")
        return value
    _typed(path, where, value, str, "a string (in quotes)")
    return _path(value) if param.name in PATH_KEYS else value


def _typed(path: Path, where: str, value, types, wanted: str):
    if isinstance(value, bool) and types is not bool:  # TOML's true is not the number 1 here
        types = ()
    if not isinstance(value, types):
        raise ConfigError(f"{path}: {where} must be {wanted}, not {_toml(value)}")
    return value


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a table"
    return str(value)


def _path(value: str) -> str:
    return os.path.expanduser(value) if value.startswith("~") else value
