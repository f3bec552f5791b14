"""DeepSpeed hostfiles (`host slots=N` per line, `#` comments): parsed strictly, errors with line numbers.

    python -m parallel.distributed.hostfile hosts      # prints "host slots" lines, or the problems (exit 2)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order; every bad line is reported at once as ValueError."""
    hosts: dict[str, int] = {}
    problems = []
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            problems.append(f"{path}:{n}: expected 'hostname slots=N', got {raw.strip()!r}")
            continue
        host, slots = m.group("host"), m.group("slots")
        if not slots.isdigit() or int(slots) < 1:
            problems.append(f"{path}:{n}: slots={slots} is not a positive whole number")
        elif host in hosts:
            problems.append(f"{path}:{n}: host {host} is listed twice")
        else:
            hosts[host] = int(slots)
    if problems:
        raise ValueError("\n".join(problems))
    if not hosts:
        raise ValueError(f"{path}: no hosts listed")
    return hosts


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m parallel.distributed.hostfile HOSTFILE", file=sys.stderr)
        return 2
    try:
        hosts = parse_hostfile(args[0])
    except (OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    for host, slots in hosts.items():
        print(host, slots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
