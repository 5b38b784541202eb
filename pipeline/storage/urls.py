"""Object-store URLs: what is one, its parts, and how it may be shown.

A credential must never reach a log, a stats reply or an error message. Credentials come from
the environment (AWS_SECRET_ACCESS_KEY...), never from the URL: a URL with user info
(`s3://KEY:SECRET@bucket`) is refused with a message that does not repeat it, and a query
string (a presigned URL's signature) is dropped wherever a URL is shown. `redact` also blanks
every secret-bearing environment value found in a text, for messages built from what a client
library said (which may quote a request).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

# Schemes served by `ObjectStore` (obstore's names for S3, GCS and Azure).
OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss"})
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Environment variables whose values are secrets (their names are fine to show).
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "GOOGLE_BEARER_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)
_MIN_SECRET_LEN = 6  # shorter values would blank ordinary words


def is_url(path: object) -> bool:
    """True for `scheme://...` (an object store, or `file://`), False for a plain path."""
    return isinstance(path, str) and bool(_URL_RE.match(path))


@dataclass(frozen=True)
class StoreURL:
    """`scheme://bucket/prefix` split up; `prefix` has no leading or trailing '/'."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def root(self) -> str:
        """The URL of the prefix, as shown to users (no credentials, no query)."""
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme}://{self.bucket}{tail}"

    def child(self, key: str) -> str:
        """The URL of `key` under the prefix."""
        return f"{self.root}/{key}"

    def parent(self) -> tuple[StoreURL, str]:
        """(the URL one level up, the last path component): an object's folder and name."""
        head, _, name = self.prefix.rpartition("/")
        return StoreURL(self.scheme, self.bucket, head), name


def parse_url(url: str) -> StoreURL:
    """Split an object-store URL; ValueError (without repeating any credential) when it is
    not one batchwire can open."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(
            f"{redact_url(url)}: unsupported URL scheme {scheme!r}; object stores are "
            f"{', '.join(sorted(OBJECT_SCHEMES))} (a local dataset is a plain path)"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{redact_url(url)}: credentials in the URL are not accepted (they would end up in "
            "logs and process listings); export them instead (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY for S3)"
        )
    if not parts.hostname:
        raise ValueError(f"{redact_url(url)}: no bucket in the URL ({scheme}://BUCKET/PREFIX)")
    return StoreURL(scheme, parts.netloc, parts.path.strip("/"))


def redact_url(url: str) -> str:
    """`url` without user info, query or fragment: safe to show."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


def redact(text: str) -> str:
    """`text` with every secret environment value blanked and URLs' user info and query
    strings removed (for messages that quote what a client library said)."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= _MIN_SECRET_LEN:
            text = text.replace(value, f"<{name}>")
    text = re.sub(r"(\w+://)[^/\s@]*@", r"\1", text)  # user info
    return re.sub(r"(\w+://[^\s?#]*)\?[^\s]*", r"\1", text)  # query strings
