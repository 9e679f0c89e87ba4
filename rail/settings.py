"""One set of defaults for the config tree and the libraries' settings classes.

A ``[learner]`` or ``[controller]`` field that a library's settings dataclass also has
(``policy.settings.LearnerSettings``; ``controller.Settings``, ``controller.SessionSettings``) has the same name
and its default is written once, in that class: the config writes ``F(SETTING, doc)`` and :func:`defaults_from`
reads it. The trainer builds the settings from the config by name (:func:`settings_from`). Imports nothing of
rail's, so the config (rail/config.py) and the modules that build settings (rail/train.py, rail/controllers.py)
can all use it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any


class _Setting:
    def __repr__(self) -> str:
        return "SETTING"


#: A config field's default placeholder: the default of the library setting of the same name (:func:`defaults_from`).
SETTING: Any = _Setting()


def defaults_from(*classes: type):
    """Class decorator, under ``@dataclass``: every field whose default is :data:`SETTING` takes the default of the
    field of the same name in the first of the settings dataclasses ``classes`` that has one (a tuple becomes a
    list: the config's sequences are lists). A name none of them has is an error at import."""

    def wrap(cls: type) -> type:
        for name, value in list(vars(cls).items()):
            if not (isinstance(value, dataclasses.Field) and value.default is SETTING):
                continue
            src = next((f for c in classes for f in dataclasses.fields(c) if f.name == name), None)
            if src is None:
                raise TypeError(f"{cls.__name__}.{name}: its default is SETTING but no field '{name}' in "
                                f"{', '.join(c.__name__ for c in classes)}")
            d = src.default if src.default is not dataclasses.MISSING else src.default_factory()
            d = list(d) if isinstance(d, tuple) else d
            if isinstance(d, (list, dict)):
                new = dataclasses.field(default_factory=lambda d=d: copy.deepcopy(d), metadata=value.metadata)
            else:
                new = dataclasses.field(default=d, metadata=value.metadata)
            setattr(cls, name, new)
        return cls

    return wrap


def settings_from(cls: type, section: Any, **given: Any) -> Any:
    """The settings dataclass ``cls`` built from a config section: every field of ``cls`` that ``section`` has by
    the same name is copied from it, ``given`` sets (or replaces) others, and the rest keep ``cls``'s defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{**{n: getattr(section, n) for n in names if hasattr(section, n)}, **given})
