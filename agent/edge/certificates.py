"""When certificates expire: ``notAfter`` read from their DER, and the warning before it.

Python's ``ssl`` module reads the dates of a peer's certificate (``getpeercert``) but offers
no public way to read those of a certificate the agent serves or trusts, and
``cryptography`` is not a dependency. So ``not_after(der)`` walks the few DER elements in
front of the date (RFC 5280, section 4.1)::

    Certificate ::= SEQUENCE {
        tbsCertificate SEQUENCE {
            version [0] EXPLICIT INTEGER OPTIONAL, serialNumber INTEGER,
            signature AlgorithmIdentifier (SEQUENCE), issuer Name (SEQUENCE),
            validity SEQUENCE { notBefore Time, notAfter Time }, ... }, ... }

where a ``Time`` is a ``UTCTime`` (``YYMMDDHHMMSSZ``; ``YY`` from 50 is 19YY, below 50 is
20YY) or a ``GeneralizedTime`` (``YYYYMMDDHHMMSSZ``), both in UTC with seconds, as RFC 5280
requires. Every length is checked against what encloses it; anything else (a truncated
element, an indefinite length, a time in another form) is a ``CertificateFormatError``.

``pem_certificates(data)`` gives the DER of each ``CERTIFICATE`` block of a PEM file (text
around the blocks is skipped, as OpenSSL does), and ``expiry_warning`` the one line the
agent logs for a certificate that expires within ``EXPIRY_WARNING_DAYS`` or has expired.

Only the standard library is imported here.
"""

from __future__ import annotations

import binascii
import re
import ssl
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

EXPIRY_WARNING_DAYS = 30  # a certificate that expires sooner than this is warned about

_SEQUENCE = 0x30
_INTEGER = 0x02
_VERSION = 0xA0  # [0] EXPLICIT, constructed
_UTC_TIME = 0x17
_GENERALIZED_TIME = 0x18
_MAX_LENGTH_OCTETS = 4  # a length of up to 4 GiB: far beyond any certificate
_PEM_BLOCK = re.compile(
    rb"-----BEGIN CERTIFICATE-----[^-]*-----END CERTIFICATE-----",
)


class CertificateFormatError(ValueError):
    """A certificate whose DER (or PEM) cannot be read; the message says where and why."""


def _element(data: bytes, offset: int, end: int) -> tuple[int, int, int]:
    """The element at ``offset`` (which must end by ``end``): (tag, start and end of its
    contents)."""
    if offset + 2 > end:
        raise CertificateFormatError(f"truncated at byte {offset}")
    tag = data[offset]
    if tag & 0x1F == 0x1F:
        raise CertificateFormatError(f"a high tag number at byte {offset}")
    first = data[offset + 1]
    start = offset + 2
    if first < 0x80:
        length = first
    elif first == 0x80:
        raise CertificateFormatError(f"an indefinite length at byte {offset} (not DER)")
    else:
        octets = first & 0x7F
        if octets > _MAX_LENGTH_OCTETS or start + octets > end:
            raise CertificateFormatError(f"a length of {octets} octets at byte {offset}")
        length = int.from_bytes(data[start : start + octets], "big")
        start += octets
    if start + length > end:
        raise CertificateFormatError(
            f"the element at byte {offset} ({length} bytes) runs past its end"
        )
    return tag, start, start + length


def _expect(data: bytes, offset: int, end: int, tag: int, what: str) -> tuple[int, int]:
    found, start, stop = _element(data, offset, end)
    if found != tag:
        raise CertificateFormatError(f"{what}: tag 0x{found:02x} where 0x{tag:02x} belongs")
    return start, stop


def _time(tag: int, text: bytes) -> datetime:
    if tag == _UTC_TIME and re.fullmatch(rb"[0-9]{12}Z", text):
        year = int(text[:2])
        year += 1900 if year >= 50 else 2000
        rest = text[2:12]
    elif tag == _GENERALIZED_TIME and re.fullmatch(rb"[0-9]{14}Z", text):
        year = int(text[:4])
        rest = text[4:14]
    else:
        raise CertificateFormatError(
            f"a validity time {text!r} (tag 0x{tag:02x}) that is neither UTCTime "
            "YYMMDDHHMMSSZ nor GeneralizedTime YYYYMMDDHHMMSSZ"
        )
    month, day, hour, minute, second = (int(rest[i : i + 2]) for i in range(0, 10, 2))
    try:
        return datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError as err:
        raise CertificateFormatError(f"a validity time {text!r}: {err}") from None


def not_after(der: bytes) -> datetime:
    """When the DER certificate ``der`` expires (its ``notAfter``, UTC); raises
    ``CertificateFormatError``."""
    start, end = _expect(der, 0, len(der), _SEQUENCE, "Certificate")
    start, end = _expect(der, start, end, _SEQUENCE, "tbsCertificate")
    offset = start
    tag, _, stop = _element(der, offset, end)
    if tag == _VERSION:
        offset = stop
    for tag, what in (
        (_INTEGER, "serialNumber"),
        (_SEQUENCE, "signature"),
        (_SEQUENCE, "issuer"),
    ):
        _, offset = _expect(der, offset, end, tag, what)
    start, end = _expect(der, offset, end, _SEQUENCE, "validity")
    _, _, after_before = _element(der, start, end)  # notBefore
    tag, start, stop = _element(der, after_before, end)
    return _time(tag, der[start:stop])


def pem_certificates(data: bytes) -> list[bytes]:
    """The DER of every ``CERTIFICATE`` block of the PEM text ``data``, in order; raises
    ``CertificateFormatError`` for a block that is not base64."""
    found: list[bytes] = []
    for number, match in enumerate(_PEM_BLOCK.finditer(data), start=1):
        try:
            found.append(ssl.PEM_cert_to_DER_cert(match.group().decode("ascii")))
        except (UnicodeDecodeError, ValueError, binascii.Error):
            raise CertificateFormatError(
                f"certificate {number} of the file is not base64 between its BEGIN and END lines"
            ) from None
    return found


def earliest_expiry(ders: Iterable[bytes]) -> datetime | None:
    """The earliest ``notAfter`` of the DER certificates ``ders`` that can be read (None if
    none can)."""
    dates = []
    for der in ders:
        try:
            dates.append(not_after(der))
        except CertificateFormatError:
            continue
    return min(dates, default=None)


def shown_date(when: datetime) -> str:
    """``2027-03-01 12:00:00 UTC``: a date as the agent's messages write it."""
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def expiry_warning(what: str, path: Path, expires: datetime, now: datetime) -> str | None:
    """The warning for ``what`` (``--tls-cert``'s certificate) in ``path`` that expires at
    ``expires``, as seen at ``now``: one line if it has expired or expires within
    ``EXPIRY_WARNING_DAYS``, else None."""
    left = expires - now
    if left <= timedelta(0):
        return (
            f"Warning: {what} {path} expired on {shown_date(expires)}: clients refuse it; "
            "put a valid one in its place and reload (SIGHUP)"
        )
    if left < timedelta(days=EXPIRY_WARNING_DAYS):
        days = left.days
        soon = "in less than a day" if days == 0 else f"in {days} day{'s' if days > 1 else ''}"
        return (
            f"Warning: {what} {path} expires on {shown_date(expires)} ({soon}): "
            "put a new one in its place and reload (SIGHUP)"
        )
    return None
