"""The real captures live in the repository, each one described in tests/fixtures/README.md."""

from __future__ import annotations

from tests.support.fixture_files import FIXTURES, H200, H200X2, REFERENCE_V101


def test_the_captures_the_tests_read_are_in_the_repository() -> None:
    for directory in (H200, H200X2, REFERENCE_V101):
        assert directory.is_dir(), f"{directory} is missing from the checkout"
    assert (H200 / "nvml-capture.json").is_file()
    assert (H200X2 / "nvml-capture.json").is_file()


def test_every_capture_is_described_in_the_readme() -> None:
    readme = (FIXTURES / "README.md").read_text()
    files = [p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "README.md"]
    assert files
    undescribed = [str(p.relative_to(FIXTURES)) for p in files if f"`{p.name}`" not in readme]
    assert not undescribed, f"say in tests/fixtures/README.md where these came from: {undescribed}"
