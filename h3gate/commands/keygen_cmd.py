"""``h3gate keygen --out KEY``: a new Ed25519 key for signing seals (KEY, mode 0600, and KEY.pub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from h3gate.commands.console import print_verdict
from h3gate.errors import EXIT_PASS
from h3gate.evidence.signing import fingerprint, write_keypair
from h3gate.paths import display


@dataclass(frozen=True)
class KeygenCommand:
    """``keygen``'s settings: the private key file to write (``KEY.pub`` goes next to it)."""

    out: Path
    json: bool = False


def keygen_command(settings: KeygenCommand) -> int:
    """Write the key pair (refusing to overwrite either file: InputError, exit 2); 0 when written."""
    out = settings.out
    pub, public = write_keypair(out)
    if settings.json:
        doc = {"private_key": display(out), "public_key": display(pub), "key_sha256": fingerprint(public)}
        print(json.dumps({**doc, "verdict": "complete"}, indent=1))
        return EXIT_PASS
    print(f"private key {display(out)} (mode 0600: keep it secret, never inside an evidence folder)")
    print(f"public key  {display(pub)} (give it to verifiers out of band)")
    print(f"key sha256  {fingerprint(public)}")
    print_verdict("complete", "an Ed25519 key pair written; h3gate seal --key signs with it")
    return EXIT_PASS
