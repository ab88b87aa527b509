"""Exit 0 when every `name==version` pin of a requirement file has a wheel in a folder, else 1
(scripts/setup_venv.sh then runs `pip download`, which takes ~50 s even when nothing is missing).

    python scripts/wheels_present.py requirements/cpu.txt ~/.cache/causalboard/wheels-cp312
"""
import re
import sys
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing(req: Path, wheels: Path) -> list[str]:
    have = set()
    for whl in wheels.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        have.add((_norm(name), version))
    out = []
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", line)
        if m is None or (_norm(m.group(1)), m.group(3)) not in have:
            out.append(line)
    return out


if __name__ == "__main__":
    gone = missing(Path(sys.argv[1]), Path(sys.argv[2]))
    if gone:
        print(f"wheels_present: {len(gone)} pin(s) without a wheel, e.g. {gone[:3]}", file=sys.stderr)
    sys.exit(1 if gone else 0)
