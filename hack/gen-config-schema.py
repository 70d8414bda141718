#!/usr/bin/env python3
"""Generate the JSON schema of the opaque config API into api/config/ (from dra_driver.node.config).

Usage: hack/gen-config-schema.py          write the files
       hack/gen-config-schema.py --check  exit 1 if the committed files differ from what would be written
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dra_driver.node.config import json_schemas

REPO = Path(__file__).resolve().parent.parent
SCHEMA_DIR = REPO / "api" / "config"


def rendered() -> dict[Path, str]:
    return {
        SCHEMA_DIR / name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    wanted = rendered()
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    unexpected = [path for path in SCHEMA_DIR.rglob("*.json") if path not in wanted]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is out of date: run hack/gen-config-schema.py", file=sys.stderr)
        for path in unexpected:
            print(f"{path.relative_to(REPO)} is not generated: remove it", file=sys.stderr)
        return 1 if stale or unexpected else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted[path])
    for path in unexpected:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
