"""Which ``remote_url`` schemes the remote tier knows, beyond its connectors."""

from __future__ import annotations

import pytest

from lmcache_async.remote import known_schemes, make_connector
from lmcache_async.remote.connector import ConnectorSettings


def test_known_schemes_name_the_mooncake_tier() -> None:
    schemes = known_schemes()
    assert "mooncake" in schemes
    assert schemes == sorted(schemes) and len(schemes) == len(set(schemes))


def test_a_connector_for_a_tier_scheme_is_refused_with_the_reason() -> None:
    settings = ConnectorSettings(timeout_s=1.0, part_size=1 << 20, ttl_s=None)
    with pytest.raises(ValueError, match="own tier"):
        make_connector("mooncake://127.0.0.1:50051", settings)
