"""Users' own functions, named ``module:function`` in the config (custom verifiers, tools and
agents), or carried in it whole as ``cloudpickle:<data>`` (the Python trainer's callables,
cluster/trainer.py: a lambda has no name to import it by)."""
from __future__ import annotations

import base64
import importlib
import sys
import zlib
from typing import Any, Callable, Sequence

PICKLED = "cloudpickle:"


def pickled(fn: Callable[..., Any]) -> str:
    """`fn` as a config value that load_function turns back into it in any process, on any node
    (the bytes travel in the config itself). Raises whatever cloudpickle raises for an object it
    cannot pickle (a lock, an open file, a socket in the closure)."""
    import cloudpickle

    return PICKLED + base64.urlsafe_b64encode(zlib.compress(cloudpickle.dumps(fn), 9)).decode("ascii")


def load_function(path: str, search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """The function named by ``module:function`` (ValueError with one line if it is not one).
    `search_path` folders go to the front of sys.path first (a `rewards.py` next to the user)."""
    for folder in reversed(list(search_path)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if str(path).startswith(PICKLED):
        return _unpickled(str(path))
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"'{path}' is not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        raise ValueError(f"cannot import '{module_name}': {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"'{module_name}' has no function '{attr}'")
    return fn


def _unpickled(value: str) -> Callable[..., Any]:
    import cloudpickle

    try:
        fn = cloudpickle.loads(zlib.decompress(base64.urlsafe_b64decode(value[len(PICKLED):].encode("ascii"))))
    except Exception as exc:  # bad data, or a module the function needs is not importable here
        raise ValueError(f"cannot load a pickled function: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"a pickled {type(fn).__name__} is not a function")
    return fn
