"""mlx-lm's model code without its tokenizer and hub sides, for the stage-worker daemon.

`import mlx_lm.<anything>` runs mlx-lm's package `__init__`, which imports its generation and
conversion helpers and, through `mlx_lm.utils` → `mlx_lm.tokenizer_utils`, transformers and torch:
8.4 s of the 8.8 s a worker took to import its server on the 2-core test machine, paid again at
every re-plan (a worker re-executes itself to leave MLX's ring); `mlx_lm.utils` also imports
huggingface_hub for its downloads (another ~0.5 s). A stage never tokenizes (vLLM does, in the
coordinator) and never downloads from a hub (weights come from the plan), so the worker daemon
calls `skip_tokenizer_side()` before its first mlx-lm import: the package is registered without
running its `__init__`, and `mlx_lm.utils` is imported with stand-ins for
`mlx_lm.tokenizer_utils` and `huggingface_hub` whose names refuse to be used. The stand-ins are
taken out of `sys.modules` again at once: only `mlx_lm.utils` holds them, and anything importing
transformers or huggingface_hub later gets the real ones. Model classes, `load_model`,
`dequantize_model` and the rest of mlx-lm stay mlx-lm's own.

Only the worker daemon does this: a process that also generates or tokenizes with mlx-lm (the
coordinator, tests) imports mlx-lm whole. Should anything in a worker reach for the package's own
top-level names (`mlx_lm.load`, ...), its real `__init__` runs then, on first use.
"""

import importlib.util
import sys
import types

_TOKENIZER = "mlx_lm.tokenizer_utils"
_HUB = "huggingface_hub"
_PACKAGE_NAMES = {"__version__", "convert", "generate", "batch_generate", "stream_generate", "load"}  # its __init__'s


class TokenizerSideSkipped(RuntimeError):
    """A stage worker reached for mlx-lm's tokenizer or hub download, which its daemon does not import."""


def skip_tokenizer_side() -> bool:
    """Make mlx-lm's model code importable without transformers. False where mlx-lm is already
    imported (nothing to save then) or is not installed."""
    if "mlx_lm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return False
    package = importlib.util.module_from_spec(spec)
    package.__getattr__ = _run_init_on_first_use(package, spec)
    sys.modules["mlx_lm"] = package
    stand_ins = {_TOKENIZER: _tokenizer_stand_in()}
    if _HUB not in sys.modules:
        stand_ins[_HUB] = _hub_stand_in()
    sys.modules.update(stand_ins)
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    return True


def _run_init_on_first_use(package: types.ModuleType, spec):
    def __getattr__(name: str):
        if name not in _PACKAGE_NAMES:  # a submodule not imported yet, or the import system's probes
            raise AttributeError(name)
        del package.__getattr__  # once: the real __init__ defines the package's names
        spec.loader.exec_module(package)
        return getattr(package, name)

    return __getattr__


def _refusing(why: str):
    def refuse(*_args, **_kwargs):
        raise TokenizerSideSkipped(why)

    return refuse


def _tokenizer_stand_in() -> types.ModuleType:
    module = types.ModuleType(_TOKENIZER, "stand-in: a stage worker does not tokenize (lean_mlx_lm.py)")
    refuse = _refusing("a stage worker does not load tokenizers (vLLM tokenizes in the coordinator)")
    module.TokenizerWrapper = type("TokenizerWrapper", (), {"__init__": refuse})
    module.load = refuse
    return module


def _hub_stand_in() -> types.ModuleType:
    module = types.ModuleType(_HUB, "stand-in: a stage worker downloads nothing from a hub (lean_mlx_lm.py)")
    module.snapshot_download = _refusing("a stage worker downloads nothing from a hub (its weights come with the plan)")
    return module
