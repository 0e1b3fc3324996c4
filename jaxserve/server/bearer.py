"""The `authorization: Bearer <key>` scheme both fronts check (the scheme in any case, RFC 9110
section 11.1; the key exactly). Its own module so the HTTP front reads it without loading grpc."""

from __future__ import annotations


def bearer_token(value: bytes) -> bytes | None:
    """The credentials of an `authorization` value whose scheme is Bearer, in any case; None for
    another scheme or none."""
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip(b" ")
