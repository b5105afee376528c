"""``controller.json_codec`` is ``json.loads`` and ``json.dumps``, judged against ``json`` itself:
the same values for every document, the same exception and message for every one that is
not JSON, the same text for every value written."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from controller import json_codec

REPO = Path(__file__).resolve().parents[3]

DOCUMENTS = [
    # what the wrapper reads: an agent's answers, docker's labels, the engine's image
    '{"Version": {"Driver": "580.159.04", "CUDA": "13.0"}, "Devices": [{"UUID": "GPU-1",'
    ' "Sharing": 2, "Sharers": 1, "MIG": null, "Power": 700.5}]}',
    '{"Lease": "lease-3", "Dev": "GPU-1 GPU-2", "Labels": {"nvidia-docker.lease": "lease-3"},'
    ' "CpusetCpus": "0-7", "CpusetMems": "0", "Expires": null}',
    '{"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}\n',
    "null\n",
    '{"Config": {"Labels": {}, "Env": ["PATH=/usr/bin"], "Cmd": null}, "Size": 123456789}',
    '{"message": "No such image: x:1"}',
    # JSON's corners
    '  \t\r\n [1, -2, 3.5e10, -0.0, 1E-7, true, false, null, "", {}, []]  \n',
    '"\\u00e9\\ud83d\\ude00 \\"quoted\\" \\\\ \\/ \\b\\f\\n\\r\\t"',
    '"\\ud800"',  # a lone surrogate, as json keeps it
    "[NaN, Infinity, -Infinity]",
    '{"a": 1, "a": 2}',
    "123456789012345678901234567890",
    '"é ✓ 😀"',
    "[" * 50 + "]" * 50,
    # not JSON: json says why
    "",
    "   ",
    "{",
    '{"a": 1,}',
    "[1, 2] extra",
    "nul",
    "'single'",
    '"\x01 control"',
    '{"a" 1}',
    "\ufeff{}",
    "<html>",
    "SSH-2.0-OpenSSH_9.2\r\n",
    "1" * 5000,  # past int's digit limit
]


def _outcome(call: object, *args: object) -> tuple[str, object]:
    try:
        value = call(*args)  # type: ignore[operator]
    except Exception as err:
        return "raised", (type(err), str(err))
    return "value", json.dumps(value, allow_nan=True)  # NaN != NaN: compare the text


@pytest.mark.parametrize("document", DOCUMENTS)
def test_loads_is_json_loads(document: str) -> None:
    assert _outcome(json_codec.loads, document) == _outcome(json.loads, document)
    data = document.encode("utf-8", "surrogatepass")
    assert _outcome(json_codec.loads, data) == _outcome(json.loads, data)


@pytest.mark.parametrize(
    "data",
    [
        '{"a": "é"}'.encode("utf-16"),
        '{"a": "é"}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32-be"),
        b"\xef\xbb\xbf{}",
        b"\xff\xfe",
        b'{"a": "\xff"}',  # not UTF-8
        bytearray(b'{"a": [1]}'),
        b"",
    ],
)
def test_other_encodings_are_json_s(data: bytes) -> None:
    assert _outcome(json_codec.loads, data) == _outcome(json.loads, data)


class Colour(float):
    """A float subclass: json writes it with float's own repr."""


VALUES: list[object] = [
    {"count": 2, "exclusive": True, "wait_s": 0.0, "owner": {"user": "bob", "image": "é/x"}},
    {"devices": "GPU-1 0:1", "cpuset": False, "mig_profile": None},
    [1, 2.5, -0.0, 1e300, float("nan"), float("inf"), -float("inf"), "a\nb\u2028\x00"],
    (1, (2, 3)),
    {3: "int key", 2.5: "float key", True: "bool key", False: "false", None: "none key"},
    "😀 \ud800",
    Colour(1.25),
    12345678901234567890,
    {},
    [],
    # not plain: json.dumps decides (and refuses these)
    {(1, 2): "tuple key"},
    {"a": {1, 2}},
    object(),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_dumps_is_json_dumps(value: object) -> None:
    assert _outcome(json_codec.dumps, value) == _outcome(json.dumps, value)


def test_random_documents_go_both_ways() -> None:
    picker = random.Random(7)

    def make(depth: int) -> object:
        kind = picker.randrange(8 if depth < 4 else 5)
        if kind == 0:
            return picker.randrange(-(10**12), 10**12)
        if kind == 1:
            return picker.uniform(-1e6, 1e6) if picker.random() < 0.9 else math.inf
        if kind == 2:
            return "".join(chr(picker.randrange(0, 0x3000)) for _ in range(picker.randrange(8)))
        if kind == 3:
            return picker.choice([True, False, None])
        if kind == 4:
            return ""
        if kind == 5:
            return [make(depth + 1) for _ in range(picker.randrange(5))]
        return {str(make(depth + 1)): make(depth + 1) for _ in range(picker.randrange(5))}

    for _ in range(500):
        value = make(0)
        text = json_codec.dumps(value)
        assert text == json.dumps(value)
        assert json_codec.dumps(json_codec.loads(text)) == json.dumps(json.loads(text))


def test_the_accelerator_is_used() -> None:
    """On this interpreter the C scanner takes the documents (else every answer above came
    from json itself, and the run path would import it)."""
    assert json_codec._FAST is not None


def test_json_is_not_imported_for_json() -> None:
    probe = (
        "import sys\n"
        "from controller import json_codec\n"
        "assert json_codec.loads(b'{\"a\": [1, 2.5, null]}') == {'a': [1, 2.5, None]}\n"
        "assert json_codec.dumps({'a': True}) == '{\"a\": true}'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('json', 're', 'enum')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"
