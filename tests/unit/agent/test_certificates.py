"""Certificates' notAfter read from their DER (``agent.edge.certificates``): real certificates made
by ``openssl`` checked against what openssl prints, and hand-made DER for every form and
every way it can be broken."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.edge.certificates import (
    EXPIRY_WARNING_DAYS,
    CertificateFormatError,
    earliest_expiry,
    expiry_warning,
    not_after,
    pem_certificates,
)
from tests.support.certs import Pki, dated_server, make_pki
from tests.support.certs import not_after as openssl_not_after


def _tlv(tag: int, contents: bytes) -> bytes:
    """One DER element (short or long length form, as DER asks)."""
    size = len(contents)
    if size < 0x80:
        return bytes([tag, size]) + contents
    octets = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(octets)]) + octets + contents


def _certificate(
    after: bytes,
    *,
    after_tag: int = 0x17,
    version: bool = True,
    issuer_size: int = 20,
) -> bytes:
    """A certificate's skeleton: what the parser walks, with real-looking fields."""
    name = _tlv(0x30, _tlv(0x31, _tlv(0x30, b"\x06\x03U\x04\x03" + _tlv(0x0C, b"x" * issuer_size))))
    fields = [
        _tlv(0xA0, _tlv(0x02, b"\x02")) if version else b"",
        _tlv(0x02, b"\x01\x23\x45"),
        _tlv(0x30, _tlv(0x06, b"\x2a\x86\x48\xce\x3d\x04\x03\x02")),
        name,
        _tlv(0x30, _tlv(0x17, b"200101000000Z") + _tlv(after_tag, after)),
        name,
        _tlv(0x30, b"\x05\x00"),  # (subjectPublicKeyInfo: never read)
    ]
    tbs = _tlv(0x30, b"".join(fields))
    return _tlv(0x30, tbs + _tlv(0x30, _tlv(0x06, b"\x2a")) + _tlv(0x03, b"\x00sig"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _der(path: Path) -> bytes:
    (der,) = pem_certificates(path.read_bytes())
    return der


def test_real_certificates_agree_with_openssl(pki: Pki) -> None:
    """UTCTime (before 2050) and GeneralizedTime (from 2050), as openssl writes them."""
    for name in ("ca", "server", "client", "other-ca"):
        assert not_after(_der(pki.pem(name))) == openssl_not_after(pki.pem(name))
    start = datetime(2020, 1, 1, tzinfo=UTC)
    for end in (
        datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2061, 7, 8, 9, 10, 11, tzinfo=UTC),
    ):
        cert, _key = dated_server(pki, f"dated-{end.year}", start, end)
        assert not_after(_der(cert)) == end == openssl_not_after(cert)


@pytest.mark.parametrize(
    ("tag", "text", "expected"),
    [
        (0x17, b"491231235959Z", datetime(2049, 12, 31, 23, 59, 59, tzinfo=UTC)),
        (0x17, b"500101000000Z", datetime(1950, 1, 1, tzinfo=UTC)),
        (0x17, b"000229120000Z", datetime(2000, 2, 29, 12, tzinfo=UTC)),
        (0x18, b"20500101000000Z", datetime(2050, 1, 1, tzinfo=UTC)),
        (0x18, b"99991231235959Z", datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_both_time_forms(tag: int, text: bytes, expected: datetime) -> None:
    assert not_after(_certificate(text, after_tag=tag)) == expected


def test_a_v1_certificate_without_version_and_long_lengths() -> None:
    der = _certificate(b"300615000000Z", version=False, issuer_size=300)
    assert der[1] == 0x82  # long-form lengths on the way
    assert not_after(der) == datetime(2030, 6, 15, tzinfo=UTC)


@pytest.mark.parametrize(
    ("tag", "text", "message"),
    [
        (0x17, b"300615000000", "neither UTCTime"),  # no Z
        (0x17, b"3006150000Z", "neither UTCTime"),  # no seconds
        (0x17, b"300615000000+0100", "neither UTCTime"),
        (0x18, b"20300615000000.5Z", "neither UTCTime"),  # fractions: not in RFC 5280
        (0x18, b"300615000000Z", "neither UTCTime"),  # UTCTime text under the other tag
        (0x17, b"301315000000Z", "month must be in 1..12"),
        (0x17, b"300230000000Z", "day is out of range"),
        (0x0C, b"300615000000Z", "tag 0x0c"),
    ],
)
def test_times_that_are_not_rfc_5280(tag: int, text: bytes, message: str) -> None:
    with pytest.raises(CertificateFormatError, match=message):
        not_after(_certificate(text, after_tag=tag))


_GOOD = _certificate(b"300615000000Z")
BROKEN = {
    "empty": b"",
    "one byte": b"\x30",
    "truncated": _GOOD[:-10],
    "not a SEQUENCE": b"\x31" + _GOOD[1:],
    "indefinite length": b"\x30\x80" + _GOOD[2:],
    "huge length": b"\x30\x89" + b"\xff" * 9 + _GOOD[2:],
    "high tag number": b"\x1f\x81\x01\x00",
    "inner length past the outer end": _GOOD[:4] + b"\x30\x7f" + _GOOD[6:],
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_der_is_refused_not_misread(case: str) -> None:
    with pytest.raises(CertificateFormatError):
        not_after(BROKEN[case])


def test_fields_out_of_order_or_missing() -> None:
    # a tbsCertificate whose fields are out of order
    tbs_fields = _tlv(0x02, b"\x01") + _tlv(0x02, b"\x01")  # serial twice: no signature
    with pytest.raises(CertificateFormatError, match="signature: tag 0x02"):
        not_after(_tlv(0x30, _tlv(0x30, tbs_fields)))
    with pytest.raises(CertificateFormatError, match="truncated"):
        not_after(_tlv(0x30, _tlv(0x30, _tlv(0x02, b"\x01"))))


def test_pem_blocks_amid_text(pki: Pki) -> None:
    ca, server = pki.pem("ca").read_bytes(), pki.pem("server").read_bytes()
    text = b"subject=CN = nvd\nissuer: F\xc5\x91 CA\n" + server + b"\n# comment\n" + ca
    ders = pem_certificates(text)
    assert [not_after(d) for d in ders] == [
        openssl_not_after(pki.pem("server")),
        openssl_not_after(pki.pem("ca")),
    ]
    assert pem_certificates(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n") == []
    broken = b"-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n"
    with pytest.raises(CertificateFormatError, match="certificate 1 of the file is not base64"):
        pem_certificates(broken)


def test_earliest_expiry_skips_what_cannot_be_read() -> None:
    early = _certificate(b"300101000000Z")
    late = _certificate(b"20600101000000Z", after_tag=0x18)
    assert earliest_expiry([late, b"junk", early]) == datetime(2030, 1, 1, tzinfo=UTC)
    assert earliest_expiry([b"junk"]) is None


def test_expiry_warning_thresholds() -> None:
    now = datetime(2030, 1, 1, 12, tzinfo=UTC)
    path = Path("/etc/tls/server.pem")

    def warn(left: timedelta) -> str | None:
        return expiry_warning("--tls-cert", path, now + left, now)

    assert warn(timedelta(days=EXPIRY_WARNING_DAYS)) is None
    assert warn(timedelta(days=400)) is None
    soon = warn(timedelta(days=EXPIRY_WARNING_DAYS, seconds=-1))
    assert soon == (
        "Warning: --tls-cert /etc/tls/server.pem expires on 2030-01-31 11:59:59 UTC "
        "(in 29 days): put a new one in its place and reload (SIGHUP)"
    )
    assert "(in 1 day)" in (warn(timedelta(days=1, hours=1)) or "")
    assert "(in less than a day)" in (warn(timedelta(hours=1)) or "")
    expired = warn(timedelta(0))
    assert expired == (
        "Warning: --tls-cert /etc/tls/server.pem expired on 2030-01-01 12:00:00 UTC: "
        "clients refuse it; put a valid one in its place and reload (SIGHUP)"
    )
    assert "\n" not in expired
