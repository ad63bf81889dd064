"""How a flag of the ``servex`` command is declared: one Flag each (its spelling, type, default, help text, and its
TensorFlow Serving or Triton counterpart), from which server/config/flags.py builds the argparse parser (so
``servex --help``) and docs/flags.md.

A flag that sets a field of ServerSettings is declared on that field, in its metadata: ``port: int = flag(8500,
PORTS, "gRPC port", tfserving=True)`` takes the field's name, type and default (``setting_flags`` reads them). The
flags the CLI reads into other settings (files, --log_level, ...), TensorFlow Serving's flags that change nothing,
and Triton's command line are Flag entries of tables: server/config/flags.py, tfserving_flags.py, triton_flags.py.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The groups of servex's own flags, in --help's and docs/flags.md's order.
PORTS = "Ports and addresses"
MODELS = "Models and versions"
VERSIONS = "Variables, client graphs and warm-up"
BATCHING = "Batching and queues"
TENSORFLOW = "TensorFlow"
GRPC = "gRPC and TLS"
ADMIN = "Admin API"
PROCESS = "Process"
OBSERVABILITY = "Tracing, profiling and request logging"
SERVEX_GROUPS = (PORTS, MODELS, VERSIONS, BATCHING, TENSORFLOW, GRPC, ADMIN, PROCESS, OBSERVABILITY)
# The other command lines servex takes, after them.
TFSERVING_OTHER = (
    "TensorFlow Serving's flags that change nothing in servex (taken so that its command lines start servex; each "
    "one given is logged with the reason)"
)
TRITON = "Triton's command line (a Triton model repository; see server/config/triton_flags.py)"


def parse_bool(text: str) -> bool:
    """A boolean flag's value, as TensorFlow Serving and Triton take them."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _SettingDefault:
    def __repr__(self) -> str:
        return "SETTING_DEFAULT"


SETTING_DEFAULT: Any = _SettingDefault()  # a Flag on a ServerSettings field: the field's default
_TYPES = {"int": int, "float": float, "str": str, "bool": parse_bool}


def _field_type(text: str) -> Any:  # a Flag on a ServerSettings field: parsed as the field's type (resolved)
    raise AssertionError("setting_flags resolves a field flag's type")


@dataclass(frozen=True)
class Flag:
    """One flag. ``type``: what parses its value (``parse_bool``: a boolean flag, given as ``--flag``,
    ``--flag=true`` or ``--flag=false``; None: a switch that takes no value, as --version)."""

    name: str  # the flag, without "--" ("" on a ServerSettings field: the field's name)
    help: str  # --help's text (argparse.SUPPRESS never: hide it with hidden=True)
    group: str
    type: Callable[[str], Any] | None = str  # on a ServerSettings field: by the field's type where not given
    default: Any = SETTING_DEFAULT  # on a ServerSettings field: the field's default, unless given here
    aliases: tuple[str, ...] = ()  # other spellings of the same flag, without "--"
    dest: str = ""  # the argparse destination; "": the name, "-" as "_"
    tfserving: bool | str = False  # TensorFlow Serving's flag: True as spelled here, or its spelling among aliases
    sets: str = ""  # a Triton flag: the servex flag whose setting it gives (its alias in docs/flags.md)
    const: Any = None  # the value of the flag given without one (then its value is optional)
    repeatable: bool = False  # each one given appends its value to a list
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    hidden: bool = False  # taken, but left out of --help (docs/flags.md lists it)
    doc: str = ""  # docs/flags.md's meaning: the help, then this
    doc_default: str = ""  # docs/flags.md's default, where the value alone says too little (or is the machine's)

    @property
    def destination(self) -> str:
        return self.dest or self.name.replace("-", "_")

    def add_to(self, group) -> None:
        """Add this flag to an argparse parser or argument group."""
        kwargs: dict[str, Any] = {"dest": self.destination, "help": argparse.SUPPRESS if self.hidden else self.help}
        if self.type is None:
            kwargs["action"] = "store_true"
        else:
            default = self.default
            if self.repeatable and default is not None:
                default = list(default)  # argparse appends to a copy
            kwargs["default"] = default
            if self.type is not str:
                kwargs["type"] = self.type
            if self.type is parse_bool:
                kwargs.update(nargs="?", const=True)
            if self.const is not None:
                kwargs.update(nargs="?", const=self.const)
            if self.repeatable:
                kwargs["action"] = "append"
            if self.metavar is not None:
                kwargs["metavar"] = self.metavar
            if self.choices is not None:
                kwargs["choices"] = self.choices
        group.add_argument(*(f"--{name}" for name in (self.name, *self.aliases)), **kwargs)


def flag(default: Any = dataclasses.MISSING, group: str = "", help: str = "", **kwargs: Any) -> Any:
    """A ServerSettings field with its flag: ``flag(default, group, help, ...)``; ``kwargs`` are Flag's
    (``default_factory`` is the field's). The flag's default is the field's unless ``flag_default`` is given."""
    factory = kwargs.pop("default_factory", dataclasses.MISSING)
    if "flag_default" in kwargs:
        kwargs["default"] = kwargs.pop("flag_default")
    kwargs.setdefault("type", _field_type)
    spec = Flag(name=kwargs.pop("name", ""), help=help, group=group, **kwargs)
    return dataclasses.field(default=default, default_factory=factory, metadata={"flag": spec})


def setting_flags(settings_class) -> list[tuple[str, Flag]]:
    """The flags declared on a settings dataclass's fields, complete (name, type, default): (field name, Flag)."""
    flags = []
    for field in dataclasses.fields(settings_class):
        spec = field.metadata.get("flag")
        if spec is None:
            continue
        changes: dict[str, Any] = {}
        if not spec.name:
            changes["name"] = field.name
        if spec.default is SETTING_DEFAULT:
            has_factory = field.default_factory is not dataclasses.MISSING
            changes["default"] = field.default_factory() if has_factory else field.default
        if spec.type is _field_type:
            changes["type"] = _TYPES[str(field.type)]  # KeyError: give the flag's type where the field's is not one
        flags.append((field.name, dataclasses.replace(spec, **changes)))
    return flags
