"""The engine's names and shapes from the trainer's: a mapping declared once, applied while packing.

A trainer and an engine often name and cut the same weights differently: a fused ``qkv_proj`` on one side,
``q_proj`` / ``k_proj`` / ``v_proj`` on the other (or ``gate_up_proj`` and ``gate_proj`` / ``up_proj``), and
other prefixes (Megatron's ``decoder.layers.N.self_attention.linear_qkv`` for ``model.layers.N.self_attn``).
A ``NameMap`` of rules says so once:

    mapping = NameMap(
        Split(r"(.*)\\.qkv_proj\\.weight", (r"\\1.q_proj.weight", r"\\1.k_proj.weight", r"\\1.v_proj.weight"),
              rows=(q_rows, kv_rows, kv_rows)),
        Rename(r"decoder\\.layers\\.(\\d+)\\.(.*)", r"model.layers.\\1.\\2"),
    )
    source = DTensorSource(model.named_parameters(), config, mapping=mapping)

Split and Fuse cut or join along dim 0, so each engine tensor is a run of ``Part``s, each a run of flat elements
of one trainer tensor, or (Transpose) a whole trainer matrix transposed (raysync.sources.gather_plan): the layout the engine sees (names, shapes) is known from
metadata alone, and the pieces of each bucket are read from the trainer's tensors straight into their places
in the ring buffer: no extra copy of any tensor. A rule whose shapes do not add up is a LayoutError naming the
tensor, raised where the source is made.

The first rule whose pattern matches a trainer name in full applies to it; a name no rule matches travels as
it is. ``include`` / ``exclude`` / ``keep_dtype`` of the SyncConfig then apply to the engine's names.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raysync.core.errors import LayoutError
from raysync.sources.gather_plan import Part


@dataclass(frozen=True)
class Rename:
    """A trainer tensor under another name: ``name`` is a template for ``re.Match.expand`` (``\\1``, ...)."""

    pattern: str
    name: str


@dataclass(frozen=True)
class Transpose:
    """A trainer matrix as its transpose on the engine (e.g. a Conv1D-style ``[in, out]`` weight for an
    ``nn.Linear``'s ``[out, in]``), under the name ``name`` (a template, as Rename's)."""

    pattern: str
    name: str


@dataclass(frozen=True)
class Split:
    """One trainer tensor as several engine tensors, cut along dim 0 into ``rows`` rows each (they must add up
    to the trainer tensor's first dim). ``names``: each engine tensor's name template, in order."""

    pattern: str
    names: tuple[str, ...]
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Fuse:
    """Several trainer tensors as one engine tensor, joined along dim 0 in the order of ``patterns`` (one
    pattern per part; the parts of one engine tensor are those whose matches capture the same groups).
    ``name``: the engine tensor's name template, expanded from the first part's match."""

    patterns: tuple[str, ...]
    name: str


@dataclass(frozen=True)
class Mapped:
    """One engine tensor: its name, global shape and dtype (the trainer's), and the trainer runs it is made of."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Part, ...]


class NameMap:
    """The rules, in order; ``apply`` maps the trainer's (name, global shape, dtype) to the engine's tensors."""

    def __init__(self, *rules: Rename | Transpose | Split | Fuse):
        self.rules = rules
        for rule in rules:
            if isinstance(rule, Split) and (len(rule.names) != len(rule.rows) or not rule.rows):
                raise LayoutError(f"{rule}: {len(rule.names)} names for {len(rule.rows)} row counts")
            if isinstance(rule, Fuse) and not rule.patterns:
                raise LayoutError(f"{rule}: no parts to fuse")

    def apply(self, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> list[Mapped]:
        out: list[Mapped | None] = []
        fused: dict[
            tuple, tuple[int, list]
        ] = {}  # (rule, groups) -> (position in out, [(part, index, match)])
        for index, (name, shape, dtype) in enumerate(tensors):
            number, which, match = self._rule(name)
            rule, shape = self.rules[number] if match else None, tuple(shape)
            if rule is None:
                out.append(Mapped(name, shape, dtype, (Part(index, 0, math.prod(shape)),)))
            elif isinstance(rule, Rename):
                out.append(Mapped(match.expand(rule.name), shape, dtype, (Part(index, 0, math.prod(shape)),)))
            elif isinstance(rule, Transpose):
                out.append(_transpose(rule, match, index, name, shape, dtype))
            elif isinstance(rule, Split):
                out.extend(_split(rule, match, index, name, shape, dtype))
            else:  # a part of a Fuse: the fused tensor takes the place of its first part met
                at, members = fused.setdefault((number, match.groups()), (len(out), []))
                if at == len(out):
                    out.append(None)
                members.append((which, index, match))
        for (number, _), (at, members) in fused.items():
            out[at] = _fuse(self.rules[number], members, tensors)
        twice = sorted(n for n, k in Counter(m.name for m in out).items() if k > 1)
        if twice:
            raise LayoutError(f"the mapping makes engine tensors {twice} more than once")
        return out

    def _rule(self, name: str) -> tuple[int, int, re.Match | None]:
        """The first rule whose pattern (for a Fuse: which of its patterns) matches ``name`` in full."""
        for number, rule in enumerate(self.rules):
            patterns = rule.patterns if isinstance(rule, Fuse) else (rule.pattern,)
            for which, pattern in enumerate(patterns):
                match = re.fullmatch(pattern, name)
                if match:
                    return number, which, match
        return -1, -1, None


def identity(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> list[Mapped]:
    """No mapping: each trainer tensor is the engine tensor of the same name."""
    return [Mapped(n, tuple(s), d, (Part(i, 0, math.prod(s)),)) for i, (n, s, d) in enumerate(tensors)]


def _transpose(rule: Transpose, match, index: int, name: str, shape: tuple[int, ...], dtype) -> Mapped:
    if len(shape) != 2:
        raise LayoutError(
            f"tensor {name!r} of shape {shape} cannot be transposed: a Transpose takes a matrix (2 dims); fix "
            f"the rule {rule.pattern!r}"
        )
    part = Part(index, 0, shape[0] * shape[1], rows=shape[0])
    return Mapped(match.expand(rule.name), (shape[1], shape[0]), dtype, (part,))


def _split(rule: Split, match, index: int, name: str, shape: tuple[int, ...], dtype) -> list[Mapped]:
    if not shape or sum(rule.rows) != shape[0] or min(rule.rows) < 0:
        raise LayoutError(
            f"tensor {name!r} of shape {shape} cannot be split into rows {rule.rows} along dim 0 "
            f"(they add up to {sum(rule.rows)}, the tensor has {shape[0] if shape else 'no dims'}): fix the "
            f"Split rule {rule.pattern!r}"
        )
    row = math.prod(shape[1:])
    out, start = [], 0
    for template, rows in zip(rule.names, rule.rows, strict=True):
        out.append(
            Mapped(match.expand(template), (rows, *shape[1:]), dtype, (Part(index, start, rows * row),))
        )
        start += rows * row
    return out


def _fuse(rule: Fuse, members: list, tensors) -> Mapped:
    by_part = {which: (index, match) for which, index, match in members}
    names = [tensors[i][0] for _, i, _ in members]
    if len(members) != len(rule.patterns) or len(by_part) != len(rule.patterns):
        raise LayoutError(
            f"tensors {names} match the Fuse rule {rule.patterns} but are not one of each of its "
            f"{len(rule.patterns)} parts: every part must be there exactly once"
        )
    first, match = by_part[0]
    name0, shape0, dtype0 = tensors[first]
    parts, rows = [], 0
    for which in range(len(rule.patterns)):
        index, _ = by_part[which]
        name, shape, dtype = tensors[index]
        if not shape or tuple(shape[1:]) != tuple(shape0[1:]) or dtype != dtype0:
            raise LayoutError(
                f"tensor {name!r} ({tuple(shape)}, {dtype}) cannot be joined along dim 0 with {name0!r} "
                f"({tuple(shape0)}, {dtype0}): the parts of a Fuse need the same trailing dims and dtype"
            )
        parts.append(Part(index, 0, math.prod(shape)))
        rows += shape[0]
    return Mapped(match.expand(rule.name), (rows, *shape0[1:]), dtype0, tuple(parts))
