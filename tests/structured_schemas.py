"""JSON schemas that structured-output tests (and the structured benchmark's
mix) check outputs against: nested objects, arrays, enums, bounded numbers,
optional fields, ``$ref``, unions, patterns and bounded string lengths.
Every string, array and number is bounded, so a random model's outputs end
well within the tests' ``max_tokens``. (Most strings are ASCII patterns: a
random model may spell a character in an overlong UTF-8 form, which
xgrammar 0.2.8 lets through and a decoder replaces.)"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "pattern": "^[A-Za-z][a-z ]{0,11}$"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": _NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"]},
    "const_and_bool": {"type": "object", "properties": {"kind": {"const": "point"},
                                                        "visible": {"type": "boolean"}},
                       "required": ["kind", "visible"]},
    "bounded_integers": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
        "required": ["x", "y"]},
    "bounded_number": {"type": "object", "properties": {
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["ratio"]},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "nickname": _NAME,
        "score": {"type": "integer", "minimum": 0, "maximum": 10}}, "required": ["id"]},
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"name": _NAME, "address": {
            "type": "object", "properties": {"city": _NAME, "zip": {
                "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]}}, "required": ["user"]},
    "array_of_enums": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"]},
    "array_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": _NAME, "qty": {
                "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}}},
        "required": ["items"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}, "minItems": 2, "maxItems": 5},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                         "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "ref_definitions": {"definitions": {"color": {"enum": ["red", "blue"]}},
                        "type": "object", "properties": {"fg": {"$ref": "#/definitions/color"},
                                                         "bg": {"$ref": "#/definitions/color"}},
                        "required": ["fg"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none", "all"]}]}},
        "required": ["value"]},
    "nullable": {"type": "object", "properties": {"note": {"anyOf": [_NAME, {"type": "null"}]}},
                 "required": ["note"]},
    "pattern": {"type": "object", "properties": {"date": {
        "type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-[0-2][0-9]$"}}, "required": ["date"]},
    "no_extra_properties": {"type": "object", "properties": {"a": {"type": "boolean"}},
                            "required": ["a"], "additionalProperties": False},
    "deep_nesting": {"type": "object", "properties": {"l1": {"type": "object", "properties": {
        "l2": {"type": "object", "properties": {"l3": {"type": "object", "properties": {
            "leaf": {"enum": [1, 2, 3]}}, "required": ["leaf"]}}, "required": ["l3"]}},
        "required": ["l2"]}}, "required": ["l1"]},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2,
                                                         "items": {"type": "array", "maxItems": 3,
                                                                   "items": {"enum": [0, 1]}}}},
               "required": ["rows"]},
    "event": {"type": "object", "properties": {
        "title": _NAME, "priority": {"enum": ["low", "high"]},
        "attendees": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/person"}},
        "all_day": {"type": "boolean"}},
        "required": ["title", "priority", "attendees"],
        "$defs": {"person": {"type": "object", "properties": {
            "name": _NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}},
            "required": ["name"]}}},
    "unique_tags": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["tags"]},
}
