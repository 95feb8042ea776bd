"""Where Dynamo's discovery is followed: a spec, or the fleet's own environment, with Dynamo's
defaults; every mistake one line naming what was given."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from projector.dynamo.discovery import DiscoveryFollower, Endpoint
from projector.dynamo.discovery_config import (
    DiscoveryConfigError,
    EtcdDiscovery,
    FileDiscovery,
    NoDiscovery,
    open_discovery,
    parse_discovery,
)
from projector.dynamo.discovery_etcd import EtcdSource
from projector.dynamo.discovery_files import FileSource
from seqstate.dynamo import DynamoEndpointError
from seqstate.errors import SeqstateError


def test_the_fleets_environment_needs_no_spec(tmp_path: Path) -> None:
    assert parse_discovery(None, {}) == EtcdDiscovery(("http://localhost:2379",))
    assert parse_discovery("", {"ETCD_ENDPOINTS": "http://10.0.0.1:2379,10.0.0.2"}) == (
        EtcdDiscovery(("http://10.0.0.1:2379", "http://10.0.0.2:2379"))
    )
    env = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path)}
    assert parse_discovery(None, env) == FileDiscovery(tmp_path)
    default = Path(tempfile.gettempdir()) / "dynamo_store_kv"
    assert parse_discovery(None, {"DYN_DISCOVERY_BACKEND": "file"}) == FileDiscovery(default)


def test_a_spec_overrides_the_environment(tmp_path: Path) -> None:
    env = {"DYN_DISCOVERY_BACKEND": "file", "ETCD_ENDPOINTS": "http://e:1"}
    assert parse_discovery("etcd:https://h:2379/,[::1]:23", env) == EtcdDiscovery(
        ("https://h:2379", "http://[::1]:23")
    )
    assert parse_discovery("etcd", env) == EtcdDiscovery(("http://e:1",))
    assert parse_discovery(f"file:{tmp_path}", env) == FileDiscovery(tmp_path)
    assert parse_discovery(" none ", env) == NoDiscovery()
    assert str(parse_discovery("etcd:h1,h2:3", {})) == "etcd:http://h1:2379,http://h2:3"


@pytest.mark.parametrize(
    ("spec", "env", "message"),
    [
        (
            "zookeeper:x",
            {},
            "discovery 'zookeeper:x' is not one of etcd[:URL[,URL...]], file[:DIR] or none",
        ),
        ("none:x", {}, "discovery 'none:x' is not one of etcd[:URL[,URL...]], file[:DIR] or none"),
        (
            "etcd:ftp://h:1",
            {},
            "etcd endpoint 'ftp://h:1' (from 'etcd:ftp://h:1') is not http(s)://HOST[:PORT]",
        ),
        (
            "etcd:http://h:99999",
            {},
            "etcd endpoint 'http://h:99999' (from 'etcd:http://h:99999') is not "
            "http(s)://HOST[:PORT]",
        ),
        (
            "etcd:http://h:1/v3",
            {},
            "etcd endpoint 'http://h:1/v3' (from 'etcd:http://h:1/v3') is not "
            "http(s)://HOST[:PORT]",
        ),
        ("etcd:,", {}, "etcd discovery from 'etcd:,': no endpoint given"),
        (
            None,
            {"ETCD_ENDPOINTS": "h1,h2:x"},
            "etcd endpoint 'h2:x' (from ETCD_ENDPOINTS=h1,h2:x) is not http(s)://HOST[:PORT]",
        ),
        (
            None,
            {"DYN_DISCOVERY_BACKEND": "kubernetes"},
            "discovery DYN_DISCOVERY_BACKEND=kubernetes: Dynamo's Kubernetes discovery is not "
            "followed yet; use the spec none (or etcd:URL / file:DIR if the fleet also "
            "registers there)",
        ),
        (
            None,
            {"DYN_DISCOVERY_BACKEND": "mem"},
            "discovery DYN_DISCOVERY_BACKEND=mem: Dynamo's in-memory discovery lives inside one "
            "process and cannot be read from outside; use the spec none",
        ),
        (
            None,
            {"ETCD_AUTH_USERNAME": "root", "ETCD_AUTH_PASSWORD": "x"},
            "ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD set: etcd user/password authentication "
            "is not supported by seqstate's discovery (TLS client certificates are: "
            "ETCD_AUTH_CA, ETCD_AUTH_CLIENT_CERT, ETCD_AUTH_CLIENT_KEY)",
        ),
        (
            "etcd",
            {"ETCD_AUTH_CLIENT_CERT": "/c.pem"},
            "ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY go together: one is set alone",
        ),
        ("etcd", {"ETCD_AUTH_CA": "/nowhere/ca.pem"}, "ETCD_AUTH_CA=/nowhere/ca.pem: no such file"),
    ],
)
def test_a_mistake_is_one_line(spec: str | None, env: dict[str, str], message: str) -> None:
    with pytest.raises(DiscoveryConfigError) as caught:
        parse_discovery(spec, env)
    assert str(caught.value) == message
    assert isinstance(caught.value, SeqstateError)


def test_a_file_where_the_directory_should_be(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(DiscoveryConfigError) as caught:
        parse_discovery(f"file:{tmp_path / 'f'}", {})
    assert str(caught.value) == (
        f"file discovery from 'file:{tmp_path / 'f'}': {tmp_path / 'f'} is not a directory"
    )


def test_a_spec_opens_its_backend(tmp_path: Path) -> None:
    etcd = open_discovery(parse_discovery("etcd:h1,h2", {}))
    assert isinstance(etcd, DiscoveryFollower) and isinstance(etcd.source, EtcdSource)
    assert etcd.describe() == "etcd discovery at http://h1:2379,http://h2:2379"
    files = open_discovery(parse_discovery(f"file:{tmp_path}", {}))
    assert isinstance(files, DiscoveryFollower) and isinstance(files.source, FileSource)
    assert files.describe() == f"file discovery in {tmp_path}"
    assert open_discovery(NoDiscovery()) is None


def test_an_endpoint_is_three_names() -> None:
    assert Endpoint.parse("dynamo.backend.generate") == Endpoint("dynamo", "backend", "generate")
    assert str(Endpoint("dynamo", "backend", "generate")) == "dynamo.backend.generate"
    with pytest.raises(DynamoEndpointError):
        Endpoint.parse("dynamo.backend")
