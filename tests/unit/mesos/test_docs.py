"""docs/mesos.md stays true: its framework decoder runs against real blobs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from mesos.blob import encode
from mesos.flags import native_flags

DOC = Path(__file__).resolve().parents[3] / "docs" / "mesos.md"
MARKER = "<!-- framework-decoder:"


def _decoder_snippet() -> str:
    text = DOC.read_text()
    after = text[text.index(MARKER) :]
    match = re.search(r"```python\n(.*?)```", after, re.DOTALL)
    assert match is not None, "the framework decoder snippet is gone from docs/mesos.md"
    return match.group(1)


@pytest.fixture(scope="module")
def gpu_info() -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(_decoder_snippet(), str(DOC), "exec"), namespace)
    return namespace["gpu_info"]


def test_the_doc_snippet_decodes_the_old_tools_blob(
    gpu_info: Any, reference_mesos_cli: str, reference_info_json: bytes
) -> None:
    blob = reference_mesos_cli.split(" ", maxsplit=1)[0].removeprefix("--attributes=gpus:")
    info = gpu_info(blob)
    assert info["Version"]["Driver"] == "580.159.04"
    assert [gpu["UUID"] for gpu in info["Devices"]] == ["GPU-87f188b6-25f1-39ad-ceb7-643fc637f1b2"]


def test_the_doc_snippet_decodes_our_blob(gpu_info: Any, reference_info_json: bytes) -> None:

    line = native_flags(reference_info_json, ["GPU-87f188b6-25f1-39ad-ceb7-643fc637f1b2"], [0])
    blob = line.split(" ")[0].removeprefix("--attributes=gpus:")
    assert blob == encode(reference_info_json)
    assert gpu_info(blob) == json.loads(reference_info_json)
