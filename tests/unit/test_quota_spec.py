"""QuotaSpec: the issue's fields, validated at decode time, normalised hosts."""

from __future__ import annotations

import msgspec
import pytest

from tangram.contract.resources import QuotaSpec
from tangram.contract.resources import checked_quota as checked
from tangram.contract.resources import decode_quota as decode_spec
from tangram.errors import InvalidRequest


def test_name_is_positional_and_limits_keyword_only() -> None:
    spec = QuotaSpec("search", per_second=5, hosts=("API.Example.com.", "[::1]:8080"))
    assert checked(spec).hosts == ("api.example.com", "[::1]:8080")
    with pytest.raises(TypeError):
        QuotaSpec("search", 5)  # type: ignore[misc]


def test_round_trip_omits_defaults_and_allows_unknown_fields() -> None:
    spec = QuotaSpec("llm", tokens_per_minute=90_000, api_key_env="OPENAI_API_KEY")
    wire = msgspec.json.encode(spec)
    assert wire == b'{"name":"llm","tokens_per_minute":90000,"api_key_env":"OPENAI_API_KEY"}'
    assert decode_spec(wire[:-1] + b',"new_field":1}') == spec


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"per_second": 0},
        {"per_second": -1.5},
        {"concurrency": 0},
        {"per_minute": 2.5},
        {"per_day": 0},
        {"tokens_per_minute": -1},
        {"per_second": 1, "hosts": ["a..b"]},
        {"per_second": 1, "hosts": ["a.com:0"]},
        {"per_second": 1, "hosts": ["a.com:99999"]},
        {"per_second": 1, "hosts": ["*.a.com"]},
        {"per_second": 1, "hosts": ["http://a.com"]},
        {"per_second": 1, "hosts": ["[::1"]},
        {"per_second": 1, "api_key_env": "1KEY"},
        {"per_second": 1, "api_key_env": "KEY-X"},
    ],
)
def test_bad_specs_refused_at_decode(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="bad quota spec"):
        decode_spec(msgspec.json.encode({"name": "q", **fields}))


@pytest.mark.parametrize("name", ["", "Upper", "-x", "a b", "x" * 65])
def test_bad_names_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match=r"\$\.name"):
        decode_spec(msgspec.json.encode({"name": name, "concurrency": 1}))


def test_checked_validates_a_spec_built_in_python() -> None:
    with pytest.raises(InvalidRequest, match="per_second"):
        checked(QuotaSpec("q", per_second=-1))
    with pytest.raises(ValueError, match="at least one limit"):
        QuotaSpec("q")


def test_windows_shortest_first() -> None:
    spec = QuotaSpec("q", per_day=1000, per_second=2, per_minute=60, concurrency=4)
    assert spec.windows() == (
        ("per_second", 2.0, 1.0),
        ("per_minute", 60.0, 60.0),
        ("per_day", 1000.0, 86_400.0),
    )
    assert spec.limits()["concurrency"] == 4
