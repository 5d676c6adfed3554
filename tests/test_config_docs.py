"""``docs/api.md`` lists every setting (no model): each field of ``KVCommConfig`` and of
``ExperimentalSettings`` appears there by name, in backticks."""

from pathlib import Path

import pytest

from kvcomm_agents import ExperimentalSettings, KVCommConfig

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.mark.parametrize("settings", [KVCommConfig, ExperimentalSettings], ids=lambda s: s.__name__)
def test_every_field_is_documented(settings):
    text = API_DOC.read_text(encoding="utf-8")
    missing = [name for name in settings.model_fields if f"`{name}`" not in text]
    assert not missing, f"docs/api.md does not mention these {settings.__name__} fields: {missing}"
