"""The gpus blob: exact round trip, any zlib decoder, and clear errors on garbage."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import zlib

import pytest

from mesos.blob import BlobError, decode, encode, extract_blob

DOCUMENTS = [
    b'{"Version":{"Driver":"580.159.04","CUDA":"13.0"},"Devices":[]}\n',
    b'{"a": "\\u00e9t\\u00e9", "b": [1, 2, null]}',
    b'{"x": "' + b"y" * 100_000 + b'"}\n',
]


def _pad(blob: str) -> str:
    return blob + "=" * (-len(blob) % 4)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_round_trip_gives_back_the_exact_bytes(document: bytes) -> None:
    assert decode(encode(document)) == document


def test_round_trip_of_the_reference_info(reference_info_json: bytes) -> None:
    assert reference_info_json.endswith(b"}\n")
    assert decode(encode(reference_info_json)) == reference_info_json


def test_the_old_tools_blob_decodes_to_its_info_json(
    reference_mesos_cli: str, reference_info_json: bytes
) -> None:
    assert decode(reference_mesos_cli) == reference_info_json
    old_blob = reference_mesos_cli.split(maxsplit=1)[0].removeprefix("--attributes=gpus:")
    assert decode(old_blob) == reference_info_json
    assert decode(_pad(old_blob)) == reference_info_json


def test_blob_uses_only_the_url_safe_alphabet_without_padding(
    reference_info_json: bytes,
) -> None:
    for document in [reference_info_json, *DOCUMENTS]:
        blob = encode(document)
        assert set(blob) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        assert not blob.endswith("=")


def test_encoding_is_deterministic(reference_info_json: bytes) -> None:
    assert encode(reference_info_json) == encode(bytes(reference_info_json))


@pytest.mark.parametrize(
    "form",
    [
        "{blob}",
        "{padded}",
        "gpus:{blob}",
        "--attributes=gpus:{blob}",
        "--attributes=rack:r1;gpus:{blob};zone:z",
        "--attributes=gpus:{blob} --resources=gpus:{{GPU-a}}\n",
        "  {blob}\n",
    ],
)
def test_decode_accepts_the_forms_a_person_pastes(form: str, reference_info_json: bytes) -> None:
    blob = encode(reference_info_json)
    assert decode(form.format(blob=blob, padded=_pad(blob))) == reference_info_json


def test_standard_library_zlib_inflates_the_blob(reference_info_json: bytes) -> None:
    raw = base64.urlsafe_b64decode(_pad(encode(reference_info_json)))
    assert zlib.decompress(raw) == reference_info_json


@pytest.mark.parametrize(
    "command",
    [["pigz", "-dz"], ["zlib-flate", "-uncompress"]],
    ids=["pigz", "zlib-flate"],
)
def test_a_decoder_that_is_not_python_inflates_the_blob(
    command: list[str], reference_info_json: bytes
) -> None:
    if shutil.which(command[0]) is None:
        pytest.fail(f"{command[0]} is missing: scripts/test-all installs it (pigz, qpdf)")
    raw = base64.urlsafe_b64decode(_pad(encode(reference_info_json)))
    result = subprocess.run(command, input=raw, capture_output=True, check=True, timeout=30)
    assert result.stdout == reference_info_json


def _garbage() -> list[tuple[str, str]]:
    good = encode(b'{"Devices": []}\n')
    raw = base64.urlsafe_b64decode(_pad(good))
    corrupted = bytearray(raw)
    corrupted[-1] ^= 0xFF
    return [
        ("", "empty input"),
        ("   \n", "empty input"),
        (good[:5] + "+" + good[6:], "'+' at position 6 is from the standard base64 alphabet"),
        (good[:3] + "/" + good[4:], "'/' at position 4 is from the standard base64 alphabet"),
        (good[:7] + "!" + good[8:], "'!' at position 8 is not base64url"),
        (good[:2] + "=" + good[3:], "padding '=' at position 3 is not at the end"),
        (good[:-4] if len(good[:-4]) % 4 != 1 else good[:-5], "truncated zlib stream"),
        (good + "A" * (5 - len(good) % 4 if len(good) % 4 != 1 else 4), "base64"),
        ("AAAAAAAA", "not a zlib stream: header bytes 0000"),
        ("eA", "too short for a zlib stream"),
        (base64.urlsafe_b64encode(bytes(corrupted)).decode(), "corrupt zlib stream"),
        (base64.urlsafe_b64encode(raw + b"junk").decode(), "trailing data after the zlib"),
        (encode(b"hello, world"), "is not JSON"),
        (encode(b"\xff\xfe{}"), "not UTF-8"),
        (encode(b"[1, 2]"), "JSON is a list, not the GPU info object"),
        (encode(b"[" * 100_000), "it nests too deep or holds a number too large"),
        (encode(b'{"Devices": ' + b"9" * 5000 + b"}"), "nests too deep or holds a number"),
        ("rack:a;zone:b", "no 'gpus:' attribute"),
        ("gpus:", "is empty"),
        ("--resources=gpus:{GPU-a} --master=x", "no --attributes= flag"),
    ]


@pytest.mark.parametrize(("text", "expected"), _garbage())
def test_decode_of_garbage_says_what_is_wrong(text: str, expected: str) -> None:
    with pytest.raises(BlobError) as caught:
        decode(text)
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message


def test_a_decompression_bomb_is_refused() -> None:
    bomb = base64.urlsafe_b64encode(zlib.compress(b" " * (64 * 1024 * 1024), 9)).decode()
    with pytest.raises(BlobError, match="inflates to more than"):
        decode(bomb)


def test_extract_blob_finds_the_gpus_attribute_among_others() -> None:
    assert extract_blob("--attributes=os:ubuntu;gpus:eJxAB;rack:7") == "eJxAB"


def test_decoded_document_is_the_json_a_framework_reads(reference_info_json: bytes) -> None:
    document = json.loads(decode(encode(reference_info_json)))
    assert document["Version"] == {"Driver": "580.159.04", "CUDA": "13.0"}
    assert [d["UUID"] for d in document["Devices"]] == ["GPU-87f188b6-25f1-39ad-ceb7-643fc637f1b2"]
