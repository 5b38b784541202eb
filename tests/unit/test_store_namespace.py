"""`ObjectStore.namespace` (what caches key bucket listings and objects by) names the service a
bucket lives on, for every scheme: a container of the same name on a local Azurite and on an
Azure account, or a bucket on fake-gcs-server and on GCS, must not share a cached listing
(reused for an hour by default). No request is made: obstore configures a store offline."""

from __future__ import annotations

import json

import pytest
from batchwire.pipeline.storage.objects import ObjectStore

_ALL = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "GOOGLE_BASE_URL",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_USE_EMULATOR",
    "AZURITE_BLOB_STORAGE_URL",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def namespace(url: str) -> str:
    return ObjectStore(url).namespace


def test_s3_names_its_endpoint_as_before(monkeypatch):
    assert namespace("s3://data/train") == "s3://data/train|"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
    assert namespace("s3://data/train") == "s3://data/train|http://127.0.0.1:8333"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    assert namespace("s3://data/train") == "s3://data/train|http://127.0.0.1:9000"


def test_azure_emulators_and_accounts_are_told_apart(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "prodaccount")
    cloud = namespace("az://sources/train")
    assert cloud == "az://sources/train|https://prodaccount.blob.core.windows.net"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "otheraccount")
    assert namespace("az://sources/train") != cloud
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:41001")
    one = namespace("az://sources/train")
    assert one == "az://sources/train|http://127.0.0.1:41001/devstoreaccount1"
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:41002")
    assert namespace("az://sources/train") != one


def test_gcs_base_urls_are_told_apart_and_the_key_is_not_shown(monkeypatch):
    key = {"gcs_base_url": "http://127.0.0.1:4443", "disable_oauth": True}
    key |= {"client_email": "", "private_key": "PRIVATEKEYMATERIAL", "private_key_id": ""}
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(key))
    one = namespace("gs://sources/train")
    assert one == "gs://sources/train|http://127.0.0.1:4443"  # only the URL of the key
    monkeypatch.setenv("GOOGLE_BASE_URL", "http://127.0.0.1:4444")  # obstore prefers it
    assert namespace("gs://sources/train") == "gs://sources/train|http://127.0.0.1:4444"
    monkeypatch.delenv("GOOGLE_BASE_URL")
    del key["gcs_base_url"]
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(key))
    assert namespace("gs://sources/train") == "gs://sources/train|"  # GCS itself
