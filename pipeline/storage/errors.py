"""Object-store errors as the `OSError`s the sample loader already tells apart.

The loader has two paths for a failed read (`decode.files.is_transient`): a transient errno
(EIO...) says nothing about the sample (retried, then the batch fails `transient` and the
client retries it; never a bad sample), anything else is the sample's (counted, logged,
replaced). obstore has already retried what its retry settings cover (5xx, timeouts, dropped
connections) by the time an error reaches us, so:

- object missing (404 NoSuchKey)              -> FileNotFoundError (ENOENT): a bad sample
- forbidden, unauthenticated (403, 401)       -> PermissionError (EACCES): a bad sample
- 5xx, 429, timeout, connection refused/reset -> OSError(EIO): transient
- credentials could not be fetched            -> OSError(EIO): transient (an instance role's
                                                 endpoint having a bad moment is not the data's)
- any other 4xx (a bad range, a bad key)      -> OSError(EINVAL): the sample's

Messages name the object by its URL (no credentials) and the store's answer in a few words
(status, S3 error code), never the request or the environment (`urls.redact`).
"""

from __future__ import annotations

import errno
import re

from batchwire.pipeline.storage.urls import redact

_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_CREDENTIAL_HINTS = ("169.254.169.254", "169.254.170.2", "credential", "/api/token")


class CredentialsError(OSError):
    """No credentials could be found or fetched (environment, instance role): at start, a
    setup problem (exit 2); during a run, transient (`errno` EIO)."""


def describe(exc: BaseException) -> str:
    """What the store said, in a few words: 'HTTP 503 SlowDown', 'HTTP error: error sending
    request' (connection refused or reset), 'no credentials could be fetched'."""
    text = str(exc)
    status = _STATUS_RE.search(text)
    code = _CODE_RE.search(text)
    if status:
        return f"HTTP {status.group(1)}{f' {code.group(1)}' if code else ''}"
    if any(h in text for h in _CREDENTIAL_HINTS):
        return "no credentials could be fetched"
    first = text.strip().splitlines()[0] if text.strip() else ""
    tail = first.rsplit(" - ", 1)[-1].strip()  # obstore: "Error performing GET URL in T - WHY"
    return redact(tail)[:200] or type(exc).__name__


def to_os_error(exc: BaseException, where: str) -> OSError:
    """`exc` (what an obstore call raised: its own exception classes, or builtin ones such as
    FileNotFoundError) as the OSError the loader expects (module doc), with a message of our
    own; `where` is the object's URL as shown to users."""
    import obstore.exceptions as oe

    text = str(exc)
    status_m = _STATUS_RE.search(text)
    status = int(status_m.group(1)) if status_m else None
    what = describe(exc)
    if any(h in text for h in _CREDENTIAL_HINTS) and not isinstance(exc, oe.NotFoundError):
        err: OSError = CredentialsError(errno.EIO, f"{where}: {what}")
    elif isinstance(exc, oe.NotFoundError | FileNotFoundError) or status == 404:
        err = FileNotFoundError(errno.ENOENT, f"{where}: no such object ({what})")
    elif isinstance(
        exc, oe.PermissionDeniedError | oe.UnauthenticatedError | PermissionError
    ) or status in (401, 403):
        err = PermissionError(errno.EACCES, f"{where}: access denied ({what})")
    elif status is None or status >= 500 or status in (408, 429):
        err = OSError(errno.EIO, f"{where}: {what} (transient, after the store's retries)")
    else:
        err = OSError(errno.EINVAL, f"{where}: refused by the store ({what})")
    err.store_detail = what  # type: ignore[attr-defined]  # for open-time messages
    return err
