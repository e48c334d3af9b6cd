"""Settings from a bench's command line: `--set field=value` and `--variant NAME:field=value,...`
make a muser_mlx.settings.Settings, which a model is loaded (or rebuilt) with; no bench changes
a module global at run time.

A value is a Python literal (ast.literal_eval), converted to the field's type where it is a
number (`prefill_headroom=5e8`, `compile_decode=0`). A product table (products,
products_by_width, glu_by_width) replaces the default table whole; its keys name formats by
name or number and its values are a ProductConfig's fields in order (rows, simd_groups, unroll,
wide, stage, int_floats, lean), e.g.
`products_by_width={("Q4_K", 6656): (2, 2, 1, 1), ("Q4_K", 4096): (2, 8)}`.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from muser_mlx.formats import GGMLType
from muser_mlx.models import build_model
from muser_mlx.settings import DEFAULT, ProductConfig, Settings

TABLES = ("products", "products_by_width", "glu_by_width")
FIELDS = {field.name for field in dataclasses.fields(Settings)}
HELP = f"field=value of muser_mlx.settings.Settings ({', '.join(sorted(FIELDS))}; bench/settings_cli.py)"


def _format(key) -> GGMLType:
    return GGMLType[key] if isinstance(key, str) else GGMLType(key)


def _table(name: str, value) -> dict:
    """A product table from its literal: format (or (format, width)) -> ProductConfig."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} takes a dict, got {value!r}")
    table = {}
    for key, config in value.items():
        key = (_format(key[0]), int(key[1])) if isinstance(key, tuple) else _format(key)
        table[key] = ProductConfig(*config)
    return table


def parse_change(change: str) -> tuple[str, object]:
    """"field=value" -> (field, value as the Settings field takes it)."""
    name, sep, text = change.partition("=")
    name = name.strip()
    if not sep or name not in FIELDS:
        raise ValueError(f"{change!r}: expected field=value with a field of Settings: {', '.join(sorted(FIELDS))}")
    value = ast.literal_eval(text.strip())
    if name in TABLES:
        return name, _table(name, value)
    default = getattr(DEFAULT, name)
    if isinstance(value, (int, float)) and isinstance(default, (bool, int, float)):
        value = type(default)(value)
    return name, value


def settings_from(changes: list[str], base: Settings = DEFAULT) -> Settings:
    """`base` with the "field=value" changes."""
    return base.replace(**dict(parse_change(change) for change in changes))


def parse_variant(variant: str) -> tuple[str, list[str]]:
    """"NAME:field=value,..." (a --variant) -> (NAME, its "field=value" changes)."""
    name, sep, changes = variant.partition(":")
    if not sep or not changes:
        raise ValueError(f"--variant {variant!r}: expected NAME:field=value,...")
    return name, re.split(r",(?=\s*\w+\s*=)", changes)  # a value may hold commas: {("Q4_K", 4096): (2, 8)}


def rebuilt(model, settings: Settings):
    """`model` when it has `settings`, else the model of the same open file built again with them
    (models.build_model over load()'s model.file: its stacked projections are copied anew, every
    other weight is shared). The caller replaces its model with the result, then calls
    gc.collect() before measuring memory: a model refers to itself through its decode steps, so
    only the collector frees the one replaced (and its stacked copies)."""
    if model.settings == settings:
        return model
    variant = build_model(model.file, settings)
    variant.file = model.file
    return variant
