"""What checking a prompt cache entry costs when it is opened: the files hashed in full, at each size.

    python -m benchmarks cache_check_cost [--rows 1000 1000000] [--reps 3] [--workdir DIR] [--out FILE]

For each size, a JSONL file of the tiny model's task (``reverse``, ``make_rows(n, 0)``, the rows of
``benchmarks/data_scale.py``) is written and built into a prompt cache entry with ``val_size`` 0.1 (not timed).
Then, in this process, each repetition times:

- ``check_warm_s``: :meth:`PromptCache.verified_meta` (``meta.json`` read, every Arrow file read in full and
  hashed) with the files in the page cache, as on a second start soon after the first;
- ``check_cold_s``: the same after ``posix_fadvise(DONTNEED)`` on the entry's files (their pages dropped from
  the page cache, nothing else's), so they are read from the disk;
- ``open_s``: :meth:`PromptCache.open` with that metadata (the memory maps; what an open cost before checks);
- ``hash_mb_s``: the hashing throughput of the warm check.

The medians and every run are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def write_task_file(n: int, path: Path) -> None:
    from rloo_lightning.tasks import get_task

    with path.open("w") as f:
        for row in get_task("reverse").make_rows(n, 0):
            f.write(json.dumps(row) + "\n")


def drop_pages(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", help="default: a temporary folder (JSONL files there are reused)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.data.cache import CHECKSUM

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cache_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = {"checksum": CHECKSUM, "reps": args.reps, "sizes": {}}
    for n in args.rows:
        data = workdir / f"reverse_{n}.jsonl"
        if not data.exists():
            write_task_file(n, data)
        dm = PromptDataModule(tokenizer_name_or_path="tiny:reverse", train_file=str(data), val_size=0.1,
                              cache_dir=str(workdir / "cache"), batch_size=16)
        dm.prepare_data()
        (cache, _, _), = dm._caches("fit")
        files = [cache.path / name for name in cache.verify()["files"]]
        runs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            meta = cache.verified_meta()
            warm = time.perf_counter() - t0
            assert meta is not None
            t0 = time.perf_counter()
            cache.open(meta)
            open_s = time.perf_counter() - t0
            drop_pages(files)
            t0 = time.perf_counter()
            assert cache.verified_meta() is not None
            cold = time.perf_counter() - t0
            runs.append({"check_warm_s": round(warm, 4), "check_cold_s": round(cold, 4), "open_s": round(open_s, 4)})
        size = sum(p.stat().st_size for p in files)
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        median["hash_mb_s"] = round(size / 2 ** 20 / median["check_warm_s"]) if median["check_warm_s"] else None
        out["sizes"][n] = {"entry_bytes": size, "median": median, "runs": runs}
        print(json.dumps({"rows": n, "entry_bytes": size, **median}), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
