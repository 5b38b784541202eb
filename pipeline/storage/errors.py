"""Object-store errors as the `OSError`s the sample loader already tells apart.

The loader has two paths for a failed read (`decode.files.is_transient`, which decides by
errno): a transient errno (EIO...) says nothing about the sample (retried, then the batch fails
`transient` and the client retries it; never a bad sample), anything else is the sample's
(counted, logged, replaced). A failure wrongly called transient is retried for ever (the
trainer ends with ServerUnavailable); one wrongly called the sample's costs one sample. So
transient is a short explicit list, and everything else is the sample's. obstore has already
retried what its retry settings cover (5xx, timeouts, dropped connections) by the time an error
reaches us. The one table (`classify`; tests/unit/test_storage_errors.py walks it):

Transient (EIO), nothing to do with the object:
- the store answered 408, 429 or 5xx (`TRANSIENT_STATUSES`);
- no answer: obstore's transport failures ("HTTP error: ...": refused, reset, timed out, a body
  cut short), a builtin ConnectionError / TimeoutError, obstore's JoinError (its runtime);
- credentials could not be fetched because the credential endpoint (an instance or container
  role, web identity, a cloud token service) did not answer, or answered 408/429/5xx: that
  endpoint having a bad moment is not the data's (`CredentialsError`, errno EIO). A run never
  starts without credentials: every source looks its store up at start (exit 2), so this is
  a blip during a run, never "no credentials at all".

The sample's (never retried):
- 404, obstore's NotFoundError, FileNotFoundError        -> FileNotFoundError (ENOENT)
- 401, 403, Unauthenticated / PermissionDenied errors     -> PermissionError (EACCES), whatever
  words the answer holds ("lacked valid authentication credentials" is the store's answer,
  not a failure to fetch credentials); the server's /readyz counts these
- the credential endpoint answered a refusal (another 4xx: no role, IMDS disabled)
                                                          -> CredentialsError (EACCES; a
                                                             PermissionError, as a 403 is)
- any other status (400, 409, 412, 416...), obstore's InvalidPath / NotSupported /
  configuration errors, a ValueError for a bad argument, anything not listed above
                                                          -> OSError (EINVAL)
- a builtin OSError (not one of the above) keeps its errno: `is_transient` decides.

Messages name the object by its URL (no credentials) and the store's answer in a few words
(status, S3 error code), never the request or the environment (`urls.redact`).
"""

from __future__ import annotations

import errno
import re
from urllib.parse import urlsplit

from batchwire.pipeline.storage.urls import redact

#: Statuses that say the store (or the path to it) is busy or failing, not the object.
TRANSIENT_STATUSES = frozenset({408, 429})  # and every 5xx: see `status_errno`

_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_REQUEST_RE = re.compile(r"Error performing \w+ (\S+)")
#: obstore's words for a request that got no answer (connect, send, timeout, body errors).
_TRANSPORT_HINT = "HTTP error"
#: Where credentials are fetched from: EC2 IMDS (IPv4 and IPv6), the ECS/EKS container
#: endpoint, GCP metadata and token, Azure AD; and STS (`sts.*.amazonaws.com`, web identity).
_CREDENTIAL_HOSTS = frozenset(
    {
        "169.254.169.254",
        "169.254.170.2",
        "fd00:ec2::254",
        "metadata.google.internal",
        "oauth2.googleapis.com",
        "login.microsoftonline.com",
    }
)
#: IMDS paths (also under an overridden metadata endpoint, AWS_EC2_METADATA_SERVICE_ENDPOINT).
_CREDENTIAL_PATHS = ("/latest/api/token", "/latest/meta-data/")


class CredentialsError(PermissionError):
    """No credentials could be found or fetched (environment, instance role): at start, a
    setup problem (exit 2); during a run, errno EIO when the credential endpoint did not
    answer (transient: `is_transient` goes by errno) and EACCES when it refused, a denied
    read as a 403 is (a PermissionError, so the sample loader's watch on denied reads,
    `pipeline.access`, counts a role taken away as it counts revoked keys)."""


class ObjectChanged(OSError):
    """A pinned object (`pin_versions` of a store: a tar shard, a Parquet file) read as
    another version: rewritten since it was indexed, so the indexed offsets hold other bytes.
    The sample's fault (no errno: a bad sample, counted, logged and replaced), not a
    transient error: reading again finds the same new object."""


def describe(exc: BaseException) -> str:
    """What the store said, in a few words: 'HTTP 503 SlowDown', 'HTTP error: error sending
    request' (connection refused or reset), 'no credentials could be fetched'."""
    text = str(exc)
    status = _STATUS_RE.search(text)
    code = _CODE_RE.search(text)
    if _is_credential_fetch(exc, text):
        return "no credentials could be fetched" + (
            f" (HTTP {status.group(1)} from the credential endpoint)" if status else ""
        )
    if status:
        return f"HTTP {status.group(1)}{f' {code.group(1)}' if code else ''}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    tail = first.rsplit(" - ", 1)[-1].strip()  # obstore: "Error performing GET URL in T - WHY"
    return redact(tail)[:200] or type(exc).__name__


def status_errno(status: int) -> int:
    """The errno of a store's HTTP answer (module doc): ENOENT, EACCES, EIO or EINVAL."""
    if status == 404:
        return errno.ENOENT
    if status in (401, 403):
        return errno.EACCES
    if status in TRANSIENT_STATUSES or status >= 500:
        return errno.EIO
    return errno.EINVAL


def _is_credential_fetch(exc: BaseException, text: str) -> bool:
    """Whether `exc` is a failure to fetch credentials (not the store's answer to a request
    made with them): the failed request went to a credential endpoint, or no request was
    made and obstore says credentials are missing."""
    import obstore.exceptions as oe

    if isinstance(exc, oe.NotFoundError | oe.PermissionDeniedError | oe.UnauthenticatedError):
        return False  # the store itself answered
    request = _REQUEST_RE.search(text)
    if request is not None:
        try:
            url = urlsplit(request.group(1))
            host = url.hostname or ""
        except ValueError:  # not a URL after all
            return False
        return (
            host in _CREDENTIAL_HOSTS
            or (host.startswith("sts.") and ".amazonaws.com" in host)
            or url.path.startswith(_CREDENTIAL_PATHS)
        )
    return _STATUS_RE.search(text) is None and "credential" in text.lower()


def classify(exc: BaseException) -> tuple[type[OSError], int]:
    """The OSError class and errno standing for `exc` (what an obstore call raised: its own
    exception classes, a builtin one, or a ValueError): the module doc's table."""
    import obstore.exceptions as oe

    text = str(exc)
    status_m = _STATUS_RE.search(text)
    status = int(status_m.group(1)) if status_m else None
    if _is_credential_fetch(exc, text):
        refused = status is not None and status_errno(status) != errno.EIO
        return CredentialsError, errno.EACCES if refused else errno.EIO
    if isinstance(exc, oe.NotFoundError | FileNotFoundError):
        return FileNotFoundError, errno.ENOENT
    if isinstance(exc, oe.PermissionDeniedError | oe.UnauthenticatedError | PermissionError):
        return PermissionError, errno.EACCES
    if status is not None:
        code = status_errno(status)
        return {errno.ENOENT: FileNotFoundError, errno.EACCES: PermissionError}.get(
            code, OSError
        ), code
    if isinstance(exc, ConnectionError | TimeoutError | oe.JoinError):
        return OSError, errno.EIO
    if _TRANSPORT_HINT in text:
        return OSError, errno.EIO
    if isinstance(exc, OSError) and exc.errno is not None:
        return OSError, exc.errno
    return OSError, errno.EINVAL


def to_os_error(exc: BaseException, where: str) -> OSError:
    """`exc` as the OSError the loader expects (`classify`), with a message of our own;
    `where` is the object's URL as shown to users."""
    kind, code = classify(exc)
    what = describe(exc)
    if kind is CredentialsError:
        why = " (transient)" if code == errno.EIO else ""
        err: OSError = CredentialsError(code, f"{where}: {what}{why}")
    elif code == errno.ENOENT:
        err = FileNotFoundError(code, f"{where}: no such object ({what})")
    elif code == errno.EACCES:
        err = PermissionError(code, f"{where}: access denied ({what})")
    elif code == errno.EIO:
        err = OSError(code, f"{where}: {what} (transient, after the store's retries)")
    elif code == errno.EINVAL:
        err = OSError(code, f"{where}: refused by the store ({what})")
    else:
        err = kind(code, f"{where}: {what}")
    err.store_detail = what  # type: ignore[attr-defined]  # for open-time messages
    return err
