"""Balancers: pluggable planners of one optimizer step, found by name.

Third-party code adds one with ``@register_balancer("name")`` on a factory (a class or a
function taking keyword options), or through the ``hf_cp.balancers`` entry-point group.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Dict, List

from .base import Balancer, PlanRequest, SampleTooLongError, max_member_tokens

_REGISTRY: Dict[str, Callable[..., Balancer]] = {}
_entry_points_loaded = False


def register_balancer(name: str):
    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a balancer named {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="hf_cp.balancers"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def available_balancers() -> List[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_balancer(name: str, **options) -> Balancer:
    _load_entry_points()
    if name not in _REGISTRY:
        raise KeyError(f"unknown balancer {name!r}; available: {', '.join(available_balancers())}")
    return _REGISTRY[name](**options)


# Built-in balancers register themselves on import; one module each.
_BUILTIN = ("static", "wlb", "skrull", "dynamic_cp", "flexsp", "libra", "megatron", "dcp", "tap", "layout", "auto")


def _import_builtins() -> None:
    from importlib import import_module
    from pathlib import Path

    here = Path(__file__).parent
    for mod in _BUILTIN:
        if (here / f"{mod}.py").exists():
            import_module(f"{__name__}.{mod}")


_import_builtins()

__all__ = [
    "Balancer",
    "PlanRequest",
    "SampleTooLongError",
    "available_balancers",
    "get_balancer",
    "max_member_tokens",
    "register_balancer",
]
