"""How a connection to the SuperLink is secured: TLS files, or insecure by explicit choice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetfl.config import ConfigError


@dataclass(frozen=True)
class Security:
    """How a connection is secured: TLS files, or insecure by explicit choice.

    For the server, `certfile`/`keyfile` are the SuperLink's certificate and key and
    `ca_certfile` the CA that signed them; for a client, only `ca_certfile` (the root it
    verifies the SuperLink with).
    """

    insecure: bool = False
    ca_certfile: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None

    def check(self, *, server: bool) -> None:
        files = {"--ssl-ca-certfile" if server else "--root-certificates": self.ca_certfile}
        if server:
            files |= {"--ssl-certfile": self.certfile, "--ssl-keyfile": self.keyfile}
        given = {k: v for k, v in files.items() if v is not None}
        if self.insecure:
            if given:
                raise ConfigError(f"--insecure cannot be combined with {', '.join(given)}")
            return
        if len(given) != len(files):
            raise ConfigError(
                "TLS is on by default and needs "
                + ", ".join(files)
                + " (see docs/deploy.md for making certificates); for a trusted local network, "
                "pass --insecure explicitly"
            )
        for flag, path in given.items():
            if not Path(path).is_file():
                raise ConfigError(f"{flag}: file {str(path)!r} does not exist")
