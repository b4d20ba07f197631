"""The grant table of ``tangram.pg_roles`` against the services' own SQL: every table a service's
code names is in its grants, a service that names none has no role, and nothing is granted on a
table no migration makes. (The privileges themselves are proven on a real cluster in
tests/integration/test_pg_roles.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tangram import db, pg_roles

SERVICES = Path(__file__).parents[2] / "services"
# SQL keywords in capitals, as the services write them (a Python ``from x import`` is not one)
_NAMED = re.compile(
    r"\b(?:FROM|INTO|UPDATE|JOIN|TABLE)\s+(\w+)|copy_records_to_table\(\s*\"(\w+)\""
)


def tables() -> set[str]:
    made = re.compile(r"CREATE (?:UNLOGGED )?TABLE IF NOT EXISTS (\w+)")
    return {t for _, _, sql in db.migrations() for t in made.findall(sql)}


def named_by(service: str) -> set[str]:
    """The tables the code of ``services/<service>`` names (the simulator aside)."""
    found: set[str] = set()
    for path in (SERVICES / service).rglob("*.py"):
        if "sim" not in path.relative_to(SERVICES / service).parts:
            found |= {a or b for a, b in _NAMED.findall(path.read_text())}
    return found & tables()


def granted(service: str) -> set[str]:
    ons = [g.on for g in pg_roles.GRANTS[service] if g.on.startswith("TABLE ")]
    return {t.strip() for on in ons for t in on.removeprefix("TABLE ").split(",")}


@pytest.mark.parametrize("service", sorted(p.name for p in SERVICES.iterdir() if p.is_dir()))
def test_a_service_is_granted_the_tables_its_code_names(service: str) -> None:
    if service.startswith("_"):
        return
    named = named_by(service)
    if service not in pg_roles.GRANTS:
        assert not named, f"{service} names {named} but has no Postgres role"
        return
    assert named <= granted(service), named - granted(service)
    assert granted(service) <= tables()
