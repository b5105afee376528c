"""Validate a CDI spec against the CDI project's published JSON schema (tests/fixtures)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "cdi-schema"


def _validator() -> Draft7Validator:
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/...": register it under that name.
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    return Draft7Validator(schema, registry=registry)


VALIDATOR = _validator()


def schema_errors(document: Mapping[str, Any]) -> list[str]:
    """Every way ``document`` breaks the schema, as ``path: message`` lines."""
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in VALIDATOR.iter_errors(document)
    ]
