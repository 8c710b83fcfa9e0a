"""The schema reference in docs/ is exactly what the generator prints from the schema (never hand-edited)."""

from dsa.manifest.schema_doc import render
from dsa.tools.testing import runfile


def test_checked_in_schema_reference_is_generated_from_the_schema():
    checked_in = runfile("docs/manifest-schema.md").read_text(encoding="utf-8")
    assert checked_in == render(), "regenerate: python -m dsa.manifest.schema_doc > docs/manifest-schema.md"


def test_reference_lists_every_top_level_field_of_the_schema():
    from dsa.manifest.contract import SCHEMA

    text = render()
    for field in SCHEMA["properties"]:
        assert f"| `{field}` |" in text, field
