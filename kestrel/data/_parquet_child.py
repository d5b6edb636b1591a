"""Read one Parquet file and write its rows, pickled, to stdout: run by `kestrel.data.reader` in a
child process (`python -P _parquet_child.py FILE`), so that a native crash in pyarrow on a damaged
file ends this process, not the studio or a worker. Imports nothing from kestrel (fast start).

Exit status: 0 with the rows on stdout; 2 with a one-line reason on stderr.
"""

from __future__ import annotations

import pickle
import sys


def main(path: str) -> int:
    """Write the rows of `path` to stdout as a pickled list of dicts."""
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises many types for damaged files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        sys.stderr.write(f"{type(exc).__name__}: {first[:300]}\n")
        return 2
    sys.stdout.buffer.write(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
