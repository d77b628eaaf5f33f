"""The shipped test data (tests/fixtures/): checksums, size budget, a README per folder, RACE-format samples."""
from __future__ import annotations

import hashlib
import json

from tests.fixtures import FIXTURES


def test_checksums_size_and_readmes():
    listed = {}
    for line in (FIXTURES / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    on_disk = {p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*")
               if p.is_file() and p.parent != FIXTURES and p.name != "README.md" and "__pycache__" not in p.parts}
    assert set(listed) == on_disk, "run: python tests/fixtures/build.py --checksums-only"
    bad = [n for n, d in listed.items() if hashlib.sha256((FIXTURES / n).read_bytes()).hexdigest() != d]
    assert not bad, f"changed fixture files: {bad}"
    assert sum((FIXTURES / n).stat().st_size for n in listed) < 10 * 2**20
    folders = {n.split("/")[0] for n in listed}
    assert len(folders) == 11  # 10 data sets + muon_oracle (a recorded oracle output)
    for folder in folders:
        readme = (FIXTURES / folder / "README.md").read_text(encoding="utf-8")
        assert "Licence" in readme and all(listed[n] in readme for n in listed if n.startswith(folder + "/"))


def test_race_samples_have_race_format():
    files = sorted((FIXTURES / "race-sample" / "RACE").glob("*/*/*.txt"))
    assert {(p.parent.parent.name, p.parent.name) for p in files} == {
        (s, lvl) for s in ("train", "dev", "test") for lvl in ("middle", "high")}
    for p in files:
        d = json.loads(p.read_text(encoding="utf-8"))
        assert d["id"] == p.parent.name + p.name
        assert len(d["questions"]) == len(d["options"]) == len(d["answers"]) > 0
        assert all(len(o) == 4 for o in d["options"]) and set(d["answers"]) <= set("ABCD")
