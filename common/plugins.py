"""Users' own functions, named ``module:function`` in the config (custom verifiers and tools)."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Sequence


def load_function(path: str, search_path: Sequence[str] = ()) -> Callable[..., Any]:
    """The function named by ``module:function`` (ValueError with one line if it is not one).
    `search_path` folders go to the front of sys.path first (a `rewards.py` next to the user)."""
    for folder in reversed(list(search_path)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
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
