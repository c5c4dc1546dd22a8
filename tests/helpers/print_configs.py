"""``python print_configs.py ARGS_JSON``: run ``rloo_lightning.cli.main`` once per argument list of the JSON list,
in this one process, and print ``[{"rc", "stdout", "stderr"}, ...]`` as JSON: the shipped configs' ``--print_config``
checks without a process start-up (the imports) per config."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from rloo_lightning.cli import main


def run(args: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    rc = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exc:  # --print_config exits once it has printed; sys.exit("message") is status 1
            if isinstance(exc.code, int):
                rc = exc.code
            elif exc.code is not None:
                rc = 1
                err.write(str(exc.code))
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    results = [run(args) for args in json.loads(sys.argv[1])]
    sys.__stdout__.write(json.dumps(results))
