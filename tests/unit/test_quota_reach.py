"""The SSRF guard: exact hosts, default ports, schemes, IP literals, redirects."""

from __future__ import annotations

import pytest

from services.quota_manager.reach import check_address, check_redirect
from tangram.contract.hosts import Target, check_url
from tangram.errors import InvalidRequest

HOSTS = ("api.example.com", "search.example.com:8443", "127.0.0.1:9000", "[::1]:9001")


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("https://api.example.com/v1?q=1", "api.example.com", 443),
        ("http://API.Example.COM./x", "api.example.com", 80),
        ("https://api.example.com:443/", "api.example.com", 443),
        ("https://search.example.com:8443/s", "search.example.com", 8443),
        ("http://127.0.0.1:9000/call", "127.0.0.1", 9000),
        ("http://[::1]:9001/", "[::1]", 9001),
    ],
)
def test_listed_hosts_pass(url: str, host: str, port: int) -> None:
    target = check_url(url, HOSTS)
    assert (target.host, target.port) == (host, port)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "scheme"),
        ("gopher://api.example.com/", "scheme"),
        ("//api.example.com/", "scheme"),
        ("https://evil.com/", "not in this quota"),
        ("https://x.api.example.com/", "not in this quota"),
        ("https://example.com/", "not in this quota"),
        ("https://api.example.com.evil.com/", "not in this quota"),
        ("https://api.example.com:8443/", "not in this quota"),
        ("https://search.example.com/", "not in this quota"),
        ("http://127.0.0.1/", "not in this quota"),
        ("http://127.0.0.1:9001/", "not in this quota"),
        ("http://localhost:9000/", "not in this quota"),
        ("http://169.254.169.254/latest/meta-data", "not in this quota"),
        ("http://2130706433:9000/", "not in this quota"),
        ("http://[::ffff:127.0.0.1]:9000/", "not in this quota"),
        ("https://api.example.com@evil.com/", "userinfo"),
        ("https://user:pw@api.example.com/", "userinfo"),
        ("https://api.example%2ecom/", "userinfo, escapes"),
        ("https://api.example.com\\@evil.com/", "backslashes"),
        ("https://api.exämple.com/", "non-ASCII"),
        ("https://api.example.com/\r\nHost: evil", "control"),
        ("https://api.example.com:99999/", "bad host or port"),
        ("https://[::1/", "not a valid URL"),
        ("https://api.example.com:x/", "bad host or port"),
        ("https:///path", "bad host or port"),
        ("https://" + "a" * 9000, "too long"),
    ],
)
def test_refused_with_a_typed_error(url: str, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why):
        check_url(url, HOSTS)


def test_redirects_follow_the_same_rule() -> None:
    here = "https://api.example.com/a/b"
    assert check_redirect("/c", here, HOSTS).url == "https://api.example.com/c"
    assert check_redirect("d", here, HOSTS).url == "https://api.example.com/a/d"
    assert check_redirect("https://search.example.com:8443/", here, HOSTS).port == 8443
    for off in ("https://evil.com/", "//evil.com/x", "file:///etc/passwd", "http://127.0.0.1/"):
        with pytest.raises(InvalidRequest):
            check_redirect(off, here, HOSTS)


def test_a_redirect_never_goes_down_from_https_to_http() -> None:
    with pytest.raises(InvalidRequest, match="from https down to http"):
        check_redirect("http://api.example.com/x", "https://api.example.com/a", HOSTS)
    assert check_redirect("https://api.example.com/x", "http://api.example.com/a", HOSTS)


def test_resolved_private_addresses_refused_unless_listed() -> None:
    target = Target("https://api.example.com/", "https", "api.example.com", 443)
    check_address(target, "93.184.216.34", HOSTS)
    for private in ("10.0.0.1", "127.0.0.1", "169.254.169.254", "::1", "fd00::1"):
        with pytest.raises(InvalidRequest, match="non-public"):
            check_address(target, private, HOSTS)
    local = Target("http://127.0.0.1:9000/", "http", "127.0.0.1", 9000)
    check_address(local, "127.0.0.1", HOSTS)
