"""`--speculative-config` as metal-cluster can serve it, checked before vLLM starts: a config it
cannot honour stops `serve` / `up` with one line naming the problem, instead of a server that
silently does not speculate, or vLLM's tracebacks from two processes.

Served: `ngram` (prompt lookup; drafts made in the scheduler, verified on the last stage),
`draft_model` (a small model of the target's vocabulary, run whole on the last stage's host: a local
folder or .gguf; stage_worker/step/speculative/draft.py) and `mtp` (the checkpoint's own multi-token-prediction
layers, on the last stage; stage_worker/step/speculative/mtp.py).
"""

import json
from pathlib import Path

from metal_cluster.stage_worker.model.model_source import text_config

FLAG = "--speculative-config"
SERVED = ("ngram", "draft_model", "mtp")


def flag_value(args: list[str]) -> str | None:
    """The last --speculative-config value in vLLM's arguments (argparse keeps the last)."""
    value = None
    for i, a in enumerate(args):
        if a == FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(FLAG + "="):
            value = a.split("=", 1)[1]
    return value


def problem(args: list[str], model_folder: Path) -> str | None:
    """What is wrong with the speculative config in `args` for this model, or None."""
    raw = flag_value(args)
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"{FLAG} is not JSON ({e.msg}): give e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'"
    if not isinstance(config, dict):
        return f"{FLAG} must be a JSON object, e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'"
    method = _method(config)
    target = _config(model_folder)
    if method not in SERVED:
        return (f"{FLAG}: method {method!r} is not served by metal-cluster; use \"ngram\" (prompt lookup, "
                "with num_speculative_tokens and optionally prompt_lookup_min/max), \"draft_model\" (with "
                "\"model\", a small model of the same tokenizer) or \"mtp\" (a checkpoint's multi-token-prediction "
                "layers)")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        return f"{FLAG}: \"{method}\" needs num_speculative_tokens, a whole number >= 1 (how many tokens to guess)"
    if method == "draft_model":
        bad = _draft_problem(config, target, model_folder)
        if bad:
            return bad
    if method == "mtp":
        bad = _mtp_problem(target, model_folder)
        if bad:
            return bad
    return _model_problem(target, model_folder)


def method(args: list[str]) -> str | None:
    """The speculative method vLLM's arguments ask for (None: none, or a config `problem` refuses)."""
    raw = flag_value(args)
    try:
        config = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        return None
    return _method(config) if isinstance(config, dict) else None


def drafter(args: list[str]) -> tuple[str | None, bool]:
    """What the last stage loads beside its layers for the speculative config in `args` (call after
    `problem` found none): (the draft model's folder or .gguf, or None; whether MTP layers draft)."""
    raw = flag_value(args)
    config = json.loads(raw) if raw is not None else {}
    kind = _method(config)
    return (config["model"] if kind == "draft_model" else None), kind == "mtp"


def with_draft_folder(args: list[str]) -> list[str]:
    """vLLM's arguments with a draft model named by the folder vLLM reads (a .gguf's derived folder,
    which the stage's loader maps back to the file). Call after `problem` found none."""
    raw = flag_value(args)
    if raw is None:
        return args
    config = json.loads(raw)
    if _method(config) != "draft_model":
        return args
    from metal_cluster.stage_worker.model.model_source import resolve_model

    value = json.dumps({**config, "method": "draft_model", "model": str(resolve_model(config["model"]).folder)})
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == FLAG:
            skip = True
            continue
        if not a.startswith(FLAG + "="):
            out.append(a)
    return [*out, FLAG, value]


def _method(config: dict) -> str | None:
    """vLLM's reading: no method but a model means a draft model, unless the model is "ngram"."""
    method, model = config.get("method"), config.get("model")
    if method is None and model is not None:
        return "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    return method


def _config(folder: Path) -> dict:
    try:
        return text_config(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def _vocab(config: dict) -> int | None:
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def _draft_problem(config: dict, target: dict, model_folder: Path) -> str | None:
    from metal_cluster.stage_worker.errors import ModelLoadError
    from metal_cluster.stage_worker.families import family_of
    from metal_cluster.stage_worker.model.model_source import resolve_model

    draft = config.get("model")
    if not draft:
        return f"{FLAG}: \"draft_model\" needs \"model\", the draft's folder or .gguf"
    for key, default in (("draft_sample_method", "greedy"), ("rejection_sample_method", "standard")):
        if config.get(key, default) != default:
            return f"{FLAG}: {key} {config[key]!r} is not served by metal-cluster; leave it out ({default!r})"
    folder_config = _config(Path(draft))  # a folder's vocabulary is the first thing to get right
    if folder_config and _vocab(folder_config) != _vocab(target):
        return _vocab_problem(draft, folder_config, target, model_folder)
    try:
        draft_config = resolve_model(draft).config
        caches = family_of(draft_config, draft).layer_caches(draft_config)
    except ModelLoadError as e:
        return f"{FLAG}: the draft model: {e}"
    if _vocab(draft_config) != _vocab(target):
        return _vocab_problem(draft, draft_config, target, model_folder)
    if any(c.state_shapes for c in caches):
        return (f"{FLAG}: the draft model {draft} ({draft_config.get('model_type')}) has recurrent layers, whose "
                "state cannot take back rejected drafts: choose a draft with attention layers only")
    return None


def _vocab_problem(draft, draft_config: dict, target: dict, model_folder: Path) -> str:
    return (f"{FLAG}: the draft model {draft} has a vocabulary of {_vocab(draft_config)} tokens, "
            f"{Path(model_folder).name} has {_vocab(target)}: a draft must use the target's tokenizer")


def _mtp_problem(target: dict, model_folder: Path) -> str | None:
    """The checkpoint must carry MTP layers its family can run (the family file knows where)."""
    from metal_cluster.stage_worker.families import family_of

    from metal_cluster.stage_worker.errors import ModelLoadError
    from metal_cluster.stage_worker.model.checkpoint_sizes import read_headers

    try:
        family = family_of(target, str(model_folder))
    except Exception:
        return None  # the model's own problem; the engine's start names it
    name = Path(model_folder).name
    if not family.mtp_layers(target):
        return (f"{FLAG}: \"mtp\" needs a checkpoint with multi-token-prediction layers, and {name} "
                f"({target.get('model_type')}) has none that metal-cluster runs (num_nextn_predict_layers of "
                "deepseek_v3 and glm4_moe): use \"ngram\" or \"draft_model\"")
    try:
        stored = read_headers(Path(model_folder))
    except ModelLoadError:
        return None  # a damaged checkpoint: the stages' load names it
    if not any(family.is_mtp_tensor(t, target) for t in stored):
        return (f"{FLAG}: {name}'s config.json names multi-token-prediction layers, but its weights do not hold "
                "them (conversions such as mlx-lm's and GGUF drop them): serve the original checkpoint for "
                "\"mtp\", or use \"ngram\" or \"draft_model\"")
    return None


def _model_problem(target: dict, model_folder: Path) -> str | None:
    """Rejected drafts leave KV behind that the next step overwrites; a recurrent layer's state
    cannot be rolled back that way."""
    from metal_cluster.stage_worker.families import family_of

    try:
        caches = family_of(target, str(model_folder)).layer_caches(target)
    except Exception:
        return None  # the model's own problem; the engine's start names it
    if any(c.state_shapes for c in caches):
        return (f"{FLAG}: {Path(model_folder).name} ({target.get('model_type')}) has recurrent layers, whose "
                "state cannot take back rejected drafts: serve it without speculative decoding")
    return None
