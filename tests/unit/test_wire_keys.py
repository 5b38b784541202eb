"""`wire.keys`: a keys folder loads, and a damaged key file is an error naming the file (never a
socket failing later without saying which file, nor the key's text in a message)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from batchwire.wire.keys import ClientKeys, KeysError, ServerKeys, create_keys


def _damage(path: Path, which: str, replace: str) -> str:
    """Rewrite ``which`` key ("public-key" / "secret-key") of ``path`` with ``replace(key)``;
    the old key's text."""
    text = path.read_text()
    key = re.search(rf'{which} = "([^"]*)"', text).group(1)  # type: ignore[union-attr]
    path.write_text(text.replace(key, replace.format(key=key)))
    return key


def test_an_intact_folder_loads_for_both_ends(tmp_path: Path) -> None:
    folder = create_keys(tmp_path / "keys")
    client, server = ClientKeys.load(folder), ServerKeys(folder)
    assert client.server_public == server.public
    assert client.public in server.allowed
    assert all(len(k) == 40 for k in (client.public, client.secret, server.secret))


@pytest.mark.parametrize(
    ("file", "which", "replace", "load"),
    [
        ("client.key_secret", "secret-key", "{key:.20}", ClientKeys.load),  # cut short
        ("client.key_secret", "public-key", "{key:.39}~", ClientKeys.load),  # not Z85
        ("server.key", "public-key", "{key}{key}", ClientKeys.load),  # too long
        ("server.key_secret", "secret-key", "{key:.30}", ServerKeys),
        ("client.key", "public-key", "{key:.39},", ServerKeys),
    ],
)
def test_a_damaged_key_names_its_file_and_not_its_text(
    tmp_path: Path, file: str, which: str, replace: str, load
) -> None:
    folder = create_keys(tmp_path / "keys")
    old = _damage(folder / file, which, replace)
    with pytest.raises(KeysError) as caught:
        load(folder)
    message = str(caught.value)
    assert str(folder / file) in message and which.split("-")[0] in message
    assert "pipeline-keys" in message
    assert old[:20] not in message  # no part of a key (a secret one) in the message
