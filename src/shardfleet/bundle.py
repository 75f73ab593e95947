"""Bundle the library into one deterministic zip that Python imports from directly.

The ``shards`` role copies this single file to the hosts (one transfer, and an
unchanged bundle is an unchanged file) and puts it on ``sys.path`` with a .pth.

    python -m shardfleet.bundle DEST.zip    # prints "written" or "unchanged"
"""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

_EPOCH = (1980, 1, 1, 0, 0, 0)


def build(dest: str | Path) -> bool:
    """Write the bundle to *dest* if its content differs; True when written."""
    pkg = Path(__file__).resolve().parent
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(pkg.rglob("*")):
            if f.is_dir() or "__pycache__" in f.parts or f.suffix not in (".py", ".yml", ".typed"):
                continue
            info = zipfile.ZipInfo(f"shardfleet/{f.relative_to(pkg).as_posix()}", _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, f.read_bytes())
    data = buf.getvalue()
    out = Path(dest)
    if out.exists() and out.read_bytes() == data:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shardfleet.bundle DEST.zip", file=sys.stderr)
        return 2
    print("written" if build(args[0]) else "unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
