"""Moving a policy's weights to a generation server on a CPU: a safetensors folder against a gloo broadcast.

    python -m benchmarks sync_transport                      # 540 MB (SmolLM2-135M in float32), 3 repeats
    python -m benchmarks sync_transport --mb 1 64 540 --repeats 5 --folder /dev/shm

The two ways :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine` could move weights without a GPU, each
timed from the sender's tensors to the receiver's:

* ``folder``: the sender writes one safetensors file (``safetensors.torch.save_file``) into a new folder and renames
  it into place (what the engine does); the receiver, another process, opens it and reads every tensor into memory
  (what the server's worker extension does before vLLM's loader copies them into its own parameters; each tensor
  is summed so that every byte is read, not only mapped). ``--folder``
  picks the file system (default: the system's temporary folder; a shared file system across nodes is slower).
* ``gloo``: a two-process gloo group on localhost (TCP); the sender broadcasts each tensor, the receiver receives
  into tensors it allocated (what a worker extension joining a gloo group would do).

The tensors are a Llama-shaped list of float32 matrices of 4 MB (the last one smaller) adding up to the size.
Prints one JSON object: per size and way, the median seconds and MB/s over ``--repeats`` (after one warm-up). It
measures the transport only; vLLM's own load (copying into its fused parameters, the same for both) is in the
engine's ``train/weight_sync_s``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench_common import emit_json

CHUNK = 2**20  # float32 elements per tensor: 4 MB


def _tensors(mb: float) -> list[torch.Tensor]:
    n = int(mb * 2**20 / 4)
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in sizes]


def _gloo_worker(rank: int, port: int, mb: float, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tensors = _tensors(mb) if rank == 0 else [torch.empty_like(t) for t in _tensors(mb)]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 1:
        ok = all(torch.equal(a, b) for a, b in zip(tensors, _tensors(mb)))
        out.put({"seconds": times[1:], "received_equal": ok})
    dist.destroy_process_group()


def _read(path: str, out) -> None:
    from safetensors import safe_open

    start = time.perf_counter()
    total = 0
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            total += t.numel()
            t.sum()  # every byte read (a file opened maps its pages; only a read costs)
    out.put((time.perf_counter() - start, total))


def _folder(mb: float, repeats: int, root: str) -> dict:
    from safetensors.torch import save_file

    tensors = {f"layer.{i}.weight": t for i, t in enumerate(_tensors(mb))}
    ctx = mp.get_context("spawn")
    writes, reads = [], []
    for i in range(repeats + 1):
        folder = os.path.join(root, f"v{i}")
        start = time.perf_counter()
        os.makedirs(folder + ".partial")
        save_file(tensors, os.path.join(folder + ".partial", "model.safetensors"))
        os.replace(folder + ".partial", folder)
        written = time.perf_counter() - start
        queue = ctx.SimpleQueue()
        reader = ctx.Process(target=_read, args=(os.path.join(folder, "model.safetensors"), queue))
        reader.start()
        read, total = queue.get()
        reader.join()
        assert total == sum(t.numel() for t in tensors.values())
        shutil.rmtree(folder)
        writes.append(written)
        reads.append(read)
    return {"write_s": writes[1:], "read_s": reads[1:], "seconds": [w + r for w, r in zip(writes[1:], reads[1:])]}


def _gloo(mb: float, repeats: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, mb, repeats, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks sync_transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, nargs="+", default=[540.0], help="sizes in MB (SmolLM2-135M fp32: 540)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--folder", default=None, help="where the folder way writes (default: the temporary folder)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="sync_transport_", dir=args.folder)
    results = []
    try:
        for mb in args.mb:
            for way in ("folder", "gloo"):
                raw = _folder(mb, args.repeats, root) if way == "folder" else _gloo(mb, args.repeats)
                median = statistics.median(raw["seconds"])
                results.append({"mb": mb, "way": way, "median_s": round(median, 4),
                                "mb_per_s": round(mb / median, 1), **{k: [round(x, 4) for x in v] if
                                                                      isinstance(v, list) else v
                                                                      for k, v in raw.items()}})
                print(f"[sync_transport] {mb:g} MB {way}: {median:.3f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}
    emit_json({"benchmark": "sync_transport", "machine": machine, "folder_root": args.folder or
               tempfile.gettempdir(), "repeats": args.repeats, "results": results}, args.out)


if __name__ == "__main__":
    main()
