"""The balancer registry: factories found by name (`get_balancer`), with `auto`'s default
members and the balancers that plan masked samples.

Third-party code adds one with ``@register_balancer("name")`` on a factory (a class or a
function taking keyword options), or through the ``hf_cp.balancers`` entry-point group. A
plugin joins `auto`'s default members only when it asks: ``register_balancer(name,
auto_member=True)``, or for an entry point an ``auto_member = True`` attribute on the
factory. A factory that declares ``options_class`` (a `BalancerOptions` dataclass) gets its
options checked by name and listed by `balancer_options`.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Type

from hf_cp.balance.options import BalancerOptions, OptionHelp, options_of

if TYPE_CHECKING:  # pragma: no cover
    from hf_cp.balance.base import Balancer

_REGISTRY: Dict[str, Callable[..., Balancer]] = {}
_AUTO_MEMBERS: Dict[str, bool] = {}
_entry_points_loaded = False


def register_balancer(name: str, auto_member: bool = False):
    """Class or function decorator: register a balancer factory under `name`.

    auto_member: whether `auto` plans with it by default. Off unless asked: a balancer joins
    every user's `auto` only when its author vouches for it.
    """

    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a balancer named {name!r} is already registered ({_REGISTRY[name]!r})")
        _REGISTRY[name] = factory
        _AUTO_MEMBERS[name] = bool(auto_member)
        return factory

    return deco


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="hf_cp.balancers"):
        if ep.name not in _REGISTRY:
            factory = ep.load()
            _REGISTRY[ep.name] = factory
            _AUTO_MEMBERS[ep.name] = getattr(factory, "auto_member", False) is True


def available_balancers() -> List[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def auto_member_balancers() -> List[str]:
    """Balancers `auto` plans with by default (those registered with auto_member=True)."""
    _load_entry_points()
    return sorted(n for n in _REGISTRY if _AUTO_MEMBERS.get(n))


def balancers_handling_masks() -> List[str]:
    """Registered balancers that declare `handles_masks` (they plan samples with masks)."""
    return [n for n in available_balancers() if getattr(_REGISTRY[n], "handles_masks", False)]


def _factory(name: str):
    _load_entry_points()
    if name not in _REGISTRY:
        raise KeyError(f"unknown balancer {name!r}; available: {', '.join(available_balancers())}")
    return _REGISTRY[name]


def get_balancer(name: str, **options) -> Balancer:
    """A new balancer `name` built with `options` (see balancer_options(name))."""
    return _factory(name)(**options)


def balancer_options(name: str) -> Optional[Type[BalancerOptions]]:
    """The options dataclass of balancer `name` (None for a plugin that declares none)."""
    return options_of(_factory(name))


def describe_options(name: str) -> List[OptionHelp]:
    """Every option of balancer `name`, with type, default and help text ([] if it declares none)."""
    cls = balancer_options(name)
    return cls.describe() if cls is not None else []
