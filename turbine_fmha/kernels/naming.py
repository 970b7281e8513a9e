"""Kernel names generated from the dataclass fields' metadata.

Each named field carries a `token` (`enum`/`number`): how its value is
written. `NameCodec` takes the order of the fields in the name, and
derives both directions from it and the tokens, so writing and parsing a
name cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import re

_ABSENT = object()


@dataclasses.dataclass(frozen=True)
class Token:
    texts: dict | None = None  # value -> text (enums and flags)
    prefix: str = ""  # numbers: the text before the digits
    omit: object = _ABSENT  # numbers: the value written as nothing

    def pattern(self, group: str) -> str:
        if self.texts is not None:
            alts = sorted({re.escape(t) for t in self.texts.values()}, key=len, reverse=True)
            return f"(?P<{group}>{'|'.join(alts)})"
        p = f"(?:{re.escape(self.prefix)}(?P<{group}>\\d+))"
        return p + ("?" if self.omit is not _ABSENT else "")

    def write(self, value) -> str:
        if self.texts is not None:
            return self.texts[value]
        return "" if value == self.omit else f"{self.prefix}{value}"

    def read(self, text):
        if self.texts is not None:
            return {t: v for v, t in self.texts.items()}[text]
        return self.omit if text is None else int(text)


def enum(texts: dict) -> dict:
    """Field metadata: the value is written as `texts[value]`."""
    return {"token": Token(texts=texts)}


def number(prefix: str, omit=_ABSENT) -> dict:
    """Field metadata: the value is written as `prefix` + digits (nothing
    when it equals `omit`)."""
    return {"token": Token(prefix=prefix, omit=omit)}


class NameCodec:
    """Names of the instances of dataclass `cls`: `stem` then the token of
    each field of `order`, which names every field that has one."""

    def __init__(self, cls, stem: str, order: tuple):
        fields = {f.name: f for f in dataclasses.fields(cls) if "token" in f.metadata}
        if sorted(order) != sorted(fields):  # pragma: no cover - a new field must take its place
            raise TypeError(f"{cls.__name__}'s name order {order} must list its named fields {sorted(fields)}")
        self.tokens = [(fields[n].metadata["token"], n) for n in order]
        self.cls = cls
        self.stem = stem
        body = "".join(tok.pattern(name) for tok, name in self.tokens)
        self.regex = re.compile(f"^{re.escape(stem)}{body}$")

    def write(self, obj) -> str:
        return self.stem + "".join(tok.write(getattr(obj, name)) for tok, name in self.tokens)

    def read(self, name: str):
        m = self.regex.match(name)
        if not m:
            raise ValueError(f"not a {self.cls.__name__} name: {name!r}")
        return self.cls(**{n: tok.read(m.group(n)) for tok, n in self.tokens})


class Named:
    """`name`, `parse` and `str` for a dataclass whose `names` class
    attribute is its NameCodec (set after the class is defined)."""

    names: NameCodec

    @functools.cached_property
    def name(self) -> str:
        # Cached: the runtime keys loaded modules by name on every call.
        return type(self).names.write(self)

    @classmethod
    def parse(cls, name: str):
        return cls.names.read(name)

    def __str__(self) -> str:
        return self.name
