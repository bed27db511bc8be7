"""The command line: what each flag accepts, checked at parse time, and one line for every bad flag.

Every entry point (train.py and its recipes, eval.py, diagnostics.py, sft.py, search.py, bench.py) builds a
``FlagParser``
and gives each flag an ``Accepts`` as its argparse ``type``; a Config field declares it beside its default
with ``flag(16, "questions per RL step", min=1)``. A value a flag does not accept stops the script before
any model loads with ``error: --flag VALUE: why`` on stderr and exit status 2, without a usage screen.
Choices of this file:
1. Choices sit on the ``type`` (``Accepts(str, choices=...)``), not on argparse's ``choices=``: one error form.
2. It imports nothing from the project, so the lowest script can use it: ``k_range`` is data.int_range's
   parse, repeated in five lines (test_flags.py checks they agree).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field


class FlagParser(argparse.ArgumentParser):
    """argparse whose every error is one line on stderr, ``error: --flag VALUE: why``, and exit status 2: a bad
    flag stops the script before any model loads, without a usage screen or a traceback."""

    def error(self, message: str):
        print("error: " + re.sub(r"^argument (\S+): ", r"\1 ", message), file=sys.stderr)
        raise SystemExit(2)


def k_range(text: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '2,4' -> [2, 4]; ValueError if neither (data.int_range, which the scripts then use)."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


@dataclass(frozen=True)
class Accepts:
    """What a flag accepts, declared beside it and used as its argparse ``type``: a number in [min, max]
    (``above``: strictly more than; ``off``: one more value that turns it off), one of ``choices``, or with
    ``int_range`` a K range 'A-B' / 'A,B' that ascends with every K >= min (default 1), or with ``ranges`` one or
    more ranges 'A-B,C-D,...' (each 'A-B' or 'A', ascending, >= min). ``unbounded`` says a
    number has no bound on purpose (a seed)."""
    kind: type = str
    min: float | None = None
    max: float | None = None
    above: float | None = None
    off: float | None = None
    choices: tuple = ()
    int_range: bool = False
    ranges: bool = False
    unbounded: bool = False

    def rejects(self, value) -> str | None:
        """Why ``value`` is refused (None: it is accepted)."""
        if self.choices:
            return None if value in self.choices else "choose " + " | ".join(self.choices)
        if self.int_range:
            try:
                ks = k_range(value)
            except ValueError:
                ks = []
            low = 1 if self.min is None else self.min
            if not ks or ks != sorted(ks) or ks[0] < low:
                return f"must be an ascending range A-B or list A,B,... of integers >= {low:g}"
            return None
        if self.ranges:
            try:
                parts = [k_range(part) for part in value.split(",")]
            except ValueError:
                parts = []
            low = 1 if self.min is None else self.min
            if not parts or any(not ks or ks[0] < low for ks in parts):
                return f"must be ranges A-B or A-B,C-D,... of integers >= {low:g}, each ascending"
            return None
        if value == self.off or (math.isfinite(value) and (self.min is None or value >= self.min) and
                                 (self.above is None or value > self.above) and
                                 (self.max is None or value <= self.max)):
            return None
        bounds = [f">= {self.min:g}"] if self.min is not None else [f"> {self.above:g}"] if self.above is not None \
            else []
        bounds += [f"<= {self.max:g}"] if self.max is not None else []
        why = "must be " + (" and ".join(bounds) or "a finite number")
        return why + (f" (or {self.off:g}: off)" if self.off is not None else "")

    def __call__(self, text: str):
        """argparse's ``type``: the text as ``kind``, or an ArgumentTypeError saying why not."""
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not {'an integer' if self.kind is int else 'a number'}") \
                from None
        why = self.rejects(value) if self.kind is not str or self.choices or self.int_range or self.ranges else None
        if why:
            raise argparse.ArgumentTypeError(f"{text}: {why}")
        return value


def flag(default, help: str, section: str = "", **accepts):
    """A Config field that is also a command-line flag: its default, its ``--help`` line and what it accepts
    (``Accepts``: min, max, above, off, choices, int_range, ranges, unbounded), side by side; ``section`` titles the
    ``--help`` group that opens at this field."""
    return field(default=default, metadata={"help": help, "accepts": Accepts(type(default), **accepts),
                                            "section": section})
