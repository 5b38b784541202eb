"""A real Azure Blob API for tests: Azurite, Microsoft's emulator (npm package `azurite`, which
scripts/setup.sh installs into .cache/azurite with the machine's Node; skipped without it).

    from azurite import azurite  # noqa: F401  (the session-scoped fixture)

    def test_x(azurite):
        azurite.upload_folder(tmp_path / "images", "container", "train")
        env = azurite.env()   # AZURE_STORAGE_USE_EMULATOR, AZURITE_BLOB_STORAGE_URL for a child

What a user exports to reach it is what `env` returns: obstore's emulator switch and the
server's URL; the account is Azurite's well-known `devstoreaccount1` with its published key
(obstore's defaults). Every request is signed with that key (Shared Key) and checked by
Azurite; nothing is mocked.

The blob service listens on a free loopback port with its data in its own temporary folder
(telemetry off), and dies with the test process (PR_SET_PDEATHSIG, as tests/objectstore.py's
SeaweedFS does).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path

import pytest
from batchwire.common.devstore import upload_folder
from emulator import Emulator, session_of

ACCOUNT = "devstoreaccount1"
# Azurite's published development key (in Microsoft's docs; not a secret).
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
API_VERSION = "2021-08-06"
START_TIMEOUT_S = 30.0
# Where scripts/setup.sh installs it (`npm install --prefix .cache/azurite azurite@...`).
SETUP_SCRIPT = Path(__file__).resolve().parents[1] / ".cache/azurite/node_modules/.bin/azurite-blob"


def azurite_command() -> list[str] | None:
    """`node azurite-blob` from scripts/setup.sh's folder, else `azurite-blob` on PATH."""
    node = shutil.which("node")
    if node and SETUP_SCRIPT.exists():
        return [node, str(SETUP_SCRIPT)]
    on_path = shutil.which("azurite-blob")
    return [on_path] if on_path and node else None


class Azurite(Emulator):
    """One Azurite blob service over folder `root` on a free 127.0.0.1 port."""

    name = "azurite"
    start_timeout_s = START_TIMEOUT_S
    poll_s = 0.1

    def command(self) -> list[str]:
        command = azurite_command()
        assert command is not None, "Azurite is not installed"
        (self.root / "data").mkdir(exist_ok=True)
        return [
            *command,
            *("--blobHost", "127.0.0.1", "--blobPort", str(self.port)),
            *("--location", str(self.root / "data")),
            "--disableTelemetry",
            "--skipApiVersionCheck",  # obstore's API version may be newer than this Azurite
            "--silent",
        ]

    def _ready(self) -> bool:
        """Azurite answers (any HTTP status: the unsigned request is refused)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/{ACCOUNT}?comp=list", timeout=2).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    # -- clients and data -------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment a user exports for this emulator (obstore's defaults name the
        account and its key)."""
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint}

    def client(self, container: str):
        """An obstore `AzureStore` over `container`, configured explicitly (not from the
        environment): the account's endpoint on this server, signed with the account key."""
        from datetime import timedelta

        from obstore.store import AzureStore

        return AzureStore(
            container,
            account_name=ACCOUNT,
            account_key=ACCOUNT_KEY,
            endpoint=f"{self.endpoint}/{ACCOUNT}",
            client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "1s"},
            retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=5)},
        )

    def create_container(self, container: str) -> None:
        """Create `container` (an existing one is fine): obstore cannot, so one Shared Key
        signed `Create Container` request."""
        date = formatdate(usegmt=True)
        # The string to sign: the verb, eleven empty standard headers (no body), the x-ms-
        # headers, then the resource (path-style: the account twice) and its query.
        signed = "\n".join(
            [
                "PUT",
                *[""] * 11,
                f"x-ms-date:{date}",
                f"x-ms-version:{API_VERSION}",
                f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container",
            ]
        )
        mac = hmac.new(base64.b64decode(ACCOUNT_KEY), signed.encode(), hashlib.sha256)
        request = urllib.request.Request(
            f"{self.endpoint}/{ACCOUNT}/{container}?restype=container",
            method="PUT",
            headers={
                "x-ms-date": date,
                "x-ms-version": API_VERSION,
                "Authorization": f"SharedKey {ACCOUNT}:{base64.b64encode(mac.digest()).decode()}",
            },
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # ContainerAlreadyExists
                raise

    def upload_folder(self, folder: str | Path, container: str, prefix: str = "") -> int:
        """Upload every regular file under `folder` to `container` (created if needed) under
        `prefix` (keys are the '/'-separated relative paths); returns how many."""
        self.create_container(container)
        return upload_folder(folder, self.client(container), prefix)


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """A running Azurite blob service for this test process (skipped when it is not
    installed); each pytest-xdist worker has its own."""
    if shutil.which("node") is None:
        pytest.skip("Azurite needs Node.js (`node` not on PATH); scripts/setup.sh installs it")
    if azurite_command() is None:
        pytest.skip(
            "Azurite not installed: scripts/setup.sh puts it in .cache/azurite "
            "(npm install --prefix .cache/azurite azurite)"
        )
    yield from session_of(Azurite, "bw-azurite-")


__all__ = ["ACCOUNT", "ACCOUNT_KEY", "Azurite", "azurite", "azurite_command"]
