"""Balancer options: one small frozen dataclass per balancer, built from plain data.

Options come from Python (``get_balancer("wlb", fill=0.9)``), from YAML
(``training.cp_balancer_options``) and from the command line (``--balancer-opt fill=0.9``).
All three go through `BalancerOptions.from_dict`, which names an unknown key with the nearest
valid ones, converts strings from the command line to the field's type (YAML scalar syntax:
``0.9``, ``null``, ``[1.0, 0.5]``), checks every value's type, and then runs the balancer's own
range checks (`check`). Each field's ``metadata["help"]`` is its help text; `describe` lists
them for ``--help`` and for error messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Type, TypeVar

import yaml

from hf_cp.readers import brief, load_yaml

T = TypeVar("T", bound="BalancerOptions")


class BalancerOptionError(ValueError):
    """A balancer option is unknown, of the wrong type or out of range; the message names it."""


@dataclass(frozen=True)
class OptionHelp:
    """One option of one balancer, for --help and error messages."""

    name: str
    type: str
    default: Any
    help: str

    def line(self) -> str:
        return f"{self.name} ({self.type}, default {self.default!r}): {self.help}"


@dataclass(frozen=True)
class BalancerOptions:
    """Base of every balancer's options. Subclasses set BALANCER and declare fields with
    ``field(default=..., metadata={"help": ...})``; `check` raises BalancerOptionError on values
    out of range. Instances are immutable and validated on construction."""

    BALANCER: ClassVar[str] = "balancer"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(getattr(self, f.name), hints[f.name], f"{self.BALANCER}: option {f.name}")
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Range checks beyond the types; raise BalancerOptionError naming the option."""

    @classmethod
    def from_dict(cls: Type[T], values: Mapping[str, Any] | None = None) -> T:
        """Options from plain data. Unknown keys are refused with the nearest valid names;
        string values (from the command line) are read as YAML scalars when the field is not a
        string."""
        values = dict(values or {})
        known = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in known:
                raise BalancerOptionError(unknown_key_message(cls.BALANCER, key, known))
        hints = typing.get_type_hints(cls)
        parsed = {k: _from_text(v, hints[k]) for k, v in values.items()}
        return cls(**parsed)

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def describe(cls) -> List[OptionHelp]:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append(OptionHelp(f.name, _type_name(hints[f.name]), _plain(default), f.metadata.get("help", "")))
        return out


def option(default: Any, help: str) -> Any:
    """A dataclass field with its help text; a dict default is copied for every instance."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def unknown_key_message(balancer: str, key: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    valid = ", ".join(known) if known else "none"
    return f"{balancer}: unknown option {key!r}{hint} (valid options: {valid})"


def parse_assignments(items: Iterable[str]) -> Dict[str, Any]:
    """``["fill=0.9", "member_options.wlb.fill=0.8"]`` -> ``{"fill": "0.9", "member_options":
    {"wlb": {"fill": "0.8"}}}``: the command line's ``--balancer-opt key=value``, values kept as
    text (from_dict converts them to each field's type). Dots nest keys."""
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BalancerOptionError(f"balancer option {item!r} must look like key=value")
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise BalancerOptionError(f"balancer option {key!r}: {p!r} is given both as a value and as a group")
            node = child
        if parts[-1] in node:
            raise BalancerOptionError(f"balancer option {key!r} is given twice")
        node[parts[-1]] = value.strip()
    return out


# ----------------------------------------------------------------------------- types
def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return f"{' or '.join(_type_name(a) for a in inner)} or null"
    if origin in (tuple, list):
        if not args:
            return "list"
        inner = _type_name(args[0])
        return f"list of ({inner})" if " or " in inner else f"list of {inner}"
    if origin in (dict, typing.Mapping) or tp is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _from_text(value: Any, tp) -> Any:
    """A command-line string read as YAML when the field does not hold strings."""
    if not isinstance(value, str) or _accepts_str(tp):
        return value
    try:
        return load_yaml(value) if value.strip() else value
    except yaml.YAMLError:  # not YAML, or a duplicate key or an alias bomb (hf_cp.readers)
        return value  # the type check names the field and the value


def _accepts_str(tp) -> bool:
    if tp is str or tp is Any:
        return True
    return typing.get_origin(tp) is typing.Union and str in typing.get_args(tp)


def _coerce(value: Any, tp, what: str) -> Any:
    """`value` as type `tp` (int -> float, list -> tuple, nested mappings checked), or
    BalancerOptionError naming `what`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, what)
            except BalancerOptionError as e:
                errors.append(e)
        raise BalancerOptionError(f"{what} must be {_type_name(tp)}, got {brief(value)}")
    if origin in (tuple, list) or tp in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise BalancerOptionError(f"{what} must be {_type_name(tp)}, got {brief(value)}")
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, f"{what}[{i}]") for i, v in enumerate(value))
    if origin in (dict, typing.Mapping, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise BalancerOptionError(f"{what} must be a mapping, got {brief(value)}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, what): _coerce(v, vt, f"{what}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise BalancerOptionError(f"{what} must be {_type_name(tp)}, got {brief(value)}")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def options_of(factory) -> Type[BalancerOptions] | None:
    """The options class a balancer factory declares (`options_class`), if any."""
    cls = getattr(factory, "options_class", None)
    return cls if isinstance(cls, type) and issubclass(cls, BalancerOptions) else None
