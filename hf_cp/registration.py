"""`attn_implementation="hf_cp"` becomes available as soon as transformers is loaded.

Importing hf_cp (any part of it) calls `register_with_transformers()`. Registration itself
needs torch and transformers (hf_cp.attention.interface), while the planning half must stay
torch-free for `hf-cp plan` and the forked planner. So: if transformers is already loaded,
register now; otherwise register right after transformers' own `__init__` runs, through a
one-shot import hook, and load nothing until then.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from importlib import import_module

INTERFACE_MODULE = "hf_cp.attention.interface"  # registers "hf_cp" when imported


def _register() -> None:
    try:
        # torch, transformers: loaded here only because transformers already is
        import_module(INTERFACE_MODULE)
    except Exception as e:  # a broken torch must not break `import transformers` itself
        warnings.warn(
            f"hf_cp could not register attn_implementation='hf_cp' with transformers: {type(e).__name__}: {e}. "
            f"Import {INTERFACE_MODULE} to see the full error.",
            stacklevel=2,
        )


class _AfterTransformersLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers` is first imported, it wraps the real loader so
    that hf_cp registers right after transformers' `__init__` has run, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; the finders after it resolve the real spec
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_then_register(module):
            load(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def register_with_transformers() -> None:
    """Register now if transformers is loaded, else as soon as it is (idempotent)."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterTransformersLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersLoads())
