"""The child process of :class:`~rloo_lightning.engines.vllm.VLLMEngine`: everything that runs in it.

:func:`serve_requests` is the target the trainer spawns (``spawn`` imports it by this module's path in the child):
it builds vLLM's engine, then answers ``build`` / ``push`` / ``generate`` / ``stats`` requests until ``close``, one at
a time in the order they came (a thread reads the pipe meanwhile, so that the trainer's sends never wait for a
generation); each request carries an id, and its answer that id and the child's own seconds on it. While it works
the child sends heartbeats (``("beat", id)``: at each request's start and, while it generates, every
``heartbeat_s``), so the trainer tells a slow child from a stuck one. :func:`_generate` steps the engine so that a
stop signal can end every row at once (for the requests sent as stoppable); :class:`_HarmlessVLLMRecords` drops two
vLLM warnings that read like failures. vLLM is imported only inside these functions, in the child: the trainer's
process never imports it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback

from rloo_lightning.runtime import sigterm


class _HarmlessVLLMRecords(logging.Filter):
    """Drops two vLLM (0.32) warnings that are harmless for this engine and read like failures:

    * ``Chat template warmup failed`` with a traceback, at build: ``LLM`` renders a chat once to compile its
      template for ``LLM.chat``; with ``skip_tokenizer_init`` there is no tokenizer to render with, and this engine
      sends token ids, never chats.
    * ``RotaryEmbedding: Failed to load weights`` (or another rotary class), at each push: ``reload_weights``
      counts a rotary embedding's cos/sin table (a buffer computed from the config, in no checkpoint) as a weight,
      finds none among the policy's, and keeps the table it had. FourierRotaryEmbedding has learned coefficients:
      its message is kept, as is every other layer's.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Chat template warmup failed":
            return False
        if record.msg == "%s: Failed to load weights" and record.args:
            layer = str(record.args[0])
            return not (layer.endswith("RotaryEmbedding") and layer != "FourierRotaryEmbedding")
        return True

    #: The module loggers that write them (vLLM 0.32). A filter on the ``vllm`` logger's handler would not last:
    #: ``LLM()`` applies vLLM's logging config again, with new handlers, before its chat template warmup.
    LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")

    @classmethod
    def install(cls) -> None:
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in logger.filters):
                logger.addFilter(cls())


class _OnceVLLMRecords(logging.Filter):
    """Passes each of vLLM's (0.32) warnings about this machine's set-up once per trainer process, not at every start
    of a child (and, for the first, four times in each):

    * ``CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.``: vLLM's CPU
      worker replaces ``torch.set_num_threads`` (the child's thread count stays the one it was started with,
      ``OMP_NUM_THREADS``), and its own model loading calls it;
    * ``OMP_NUM_THREADS=... is set; leaving Torch threads at ...``;
    * ``libtcmalloc`` / ``libiomp is not found in LD_PRELOAD``.

    ``said`` (the environment variable :data:`SAID_ENV`, set by the trainer) names those an earlier child of the
    trainer's process said already; :attr:`said` grows with those this child says, and the ``build`` answer hands
    them back to the trainer."""

    #: name -> (the module logger that writes it, the start of its message template)
    WARNINGS = {
        "threads-bound": ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`"),
        "omp-threads": ("vllm.utils.torch_utils", "OMP_NUM_THREADS=%s is set; leaving Torch threads"),
        "ld-preload": ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD"),
    }
    SAID_ENV = "RLOO_VLLM_SAID_ONCE"
    said: set[str] = set()

    def __init__(self, name: str, prefix: str) -> None:
        super().__init__()
        self.name_, self.prefix = name, prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self.prefix):
            return True
        key = self.name_ + (f":{record.args[0]}" if self.name_ == "ld-preload" and record.args else "")
        if key in _OnceVLLMRecords.said:
            return False
        _OnceVLLMRecords.said.add(key)
        return True

    @classmethod
    def install(cls) -> None:
        import os

        cls.said = set(filter(None, os.environ.get(cls.SAID_ENV, "").split(",")))
        for name, (logger_name, prefix) in cls.WARNINGS.items():
            logger = logging.getLogger(logger_name)
            if not any(isinstance(f, cls) and f.name_ == name for f in logger.filters):
                logger.addFilter(cls(name, prefix))


def _read(conn, requests: queue.SimpleQueue) -> None:
    """The child's reading thread: every request into ``requests`` as it comes, None when the pipe closes. The
    trainer's ``send`` thus never blocks on a child busy generating (and two large messages, a request and an
    answer, can never wait on each other)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            requests.put(None)
            return
        requests.put(message)
        if message[0] == "close":
            return


class _TrainerGone(Exception):
    """The pipe to the trainer broke: nobody is left to answer."""


class _Heartbeat:
    """Sends ``("beat", request id)`` when called, at most every ``every`` seconds (``force``: now);
    :class:`_TrainerGone` when the trainer's end of the pipe is closed."""

    def __init__(self, conn, rid: int, every: float) -> None:
        self.conn, self.rid, self.every, self.last = conn, rid, every, float("-inf")

    def __call__(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every:
            try:
                self.conn.send(("beat", self.rid))
            except (BrokenPipeError, ConnectionResetError) as err:
                raise _TrainerGone from err
            self.last = now


def serve_requests(conn, stop_event, heartbeat_s: float = 2.0) -> None:
    """The child: answer ``(verb, id, args, stoppable)`` requests in order until ``close`` (or the pipe closes).

    Answers are ``("answer", id, status, value, seconds)``: status ``ok``, ``refused`` (value: the reason) or
    ``error`` (value: the traceback); seconds: this process's time on the request, from its start to its answer.
    ``stop_event`` cuts a ``generate`` short only when the request is ``stoppable`` (a synchronous generate; a
    submitted one is sampled in full, its rollout goes into a checkpoint)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer decides when to stop, and stops this process
    sigterm.ignore_sigint()
    requests: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, requests), daemon=True, name="rloo-vllm-requests").start()
    llm, buffers = None, None
    loras: dict = {}  # version -> LoRARequest: the adapters loaded (lora_sync: adapter)
    while True:
        message = requests.get()
        if message is None or message[0] == "close":
            return
        verb, rid, args, stoppable = message
        start = time.perf_counter()
        beat = _Heartbeat(conn, rid, heartbeat_s)
        try:
            beat(force=True)
            status, value = "ok", None
            if verb == "build":
                from vllm import LLM, ModelRegistry

                _HarmlessVLLMRecords.install()
                _OnceVLLMRecords.install()
                supported = set(ModelRegistry.get_supported_archs())
                if any(a in supported for a in args[1]):
                    llm = LLM(**args[0])
                    value = sorted(_OnceVLLMRecords.said)  # for the trainer: said, not to be said by a later child
                else:
                    status, value = "refused", (f"VLLMEngine: vLLM does not support the policy's architecture "
                                                f"{args[1]}; use the default engine (generation_engine: null)")
            elif verb == "push":
                if args[0] is not None:
                    buffers = args[0]
                _wake(llm, None, loras)
                _load(llm, buffers, loras)
            elif verb == "adapter":  # (folder, version, canary ids or None): a new adapter, the older ones removed
                _wake(llm, buffers, loras)
                value = _add_adapter(llm, loras, *args)
            elif verb == "stats":
                import resource

                value = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            elif verb == "generate":
                # Asleep after an earlier request (sleep_level): a generate sent with no push between (a
                # validation batch, or one queued behind a submitted request) wakes the engine itself.
                _wake(llm, buffers, loras)
                lora = loras[args[4]] if args[4] is not None else None
                value = _generate(llm, *args[:3], stop_event if stoppable else None, beat, lora)
                if args[3] and requests.empty():  # another request waiting would only wake it again
                    llm.sleep(level=args[3])
                    llm._rloo_asleep = args[3]
            else:
                raise ValueError(f"unknown request {verb!r}")
        except _TrainerGone:
            return
        except Exception:
            status, value = "error", traceback.format_exc()
        try:
            conn.send(("answer", rid, status, value, time.perf_counter() - start))
        except (BrokenPipeError, ConnectionResetError):
            return


def _load(llm, buffers, loras: dict) -> None:
    """Load the weights in the shared buffers and forget every cached prompt block (they hold the old weights'). A
    reload drops every LoRA adapter (vLLM 0.32): those of ``loras`` are loaded again (from their folders)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(buffers)})
    llm.reset_prefix_cache()
    for request in loras.values():
        llm.llm_engine.add_lora(request)


def _wake(llm, buffers, loras: dict) -> None:
    """Wake an engine put to sleep after a generate. At level 2 its weights were dropped: ``buffers`` (the last
    push, which every request since was sent to sample with: the trainer writes them only when no request is
    pending) are loaded again; None: the caller loads them itself."""
    level = getattr(llm, "_rloo_asleep", 0)
    if not level:
        return
    llm.wake_up()
    llm._rloo_asleep = 0
    if level == 2 and buffers is not None:
        _load(llm, buffers, loras)


def _add_adapter(llm, loras: dict, folder: str, version: int, canary: list[int] | None) -> list[float] | None:
    """Load adapter ``version`` from ``folder`` (a new name and id: vLLM caches by id), remove the older ones (the
    child answers in order: no request still needs them), and return the canary's log-probs under it (``canary``:
    token ids; None: no canary)."""
    from vllm.lora.request import LoRARequest

    from rloo_lightning.engines.vllm_lora import adapter_name

    request = LoRARequest(adapter_name(version), version, folder)
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the adapter in {folder}")
    for old in [v for v in loras if v != version]:
        llm.llm_engine.remove_lora(old)
        del loras[old]
    loras[version] = request
    return None if canary is None else _prompt_logprobs(llm, canary, request)


def _prompt_logprobs(llm, ids: list[int], lora) -> list[float]:
    """vLLM's log-probs of ``ids[1:]`` given the tokens before each (temperature 1: the policy's distribution)."""
    from vllm import SamplingParams

    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
                       lora_request=lora, use_tqdm=False)[0]
    return [float(step[tok].logprob) for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]


def _generate(llm, prompts: list[list[int]], params: dict, seeds: list[int], stop_event, beat=None,
              lora=None) -> list:
    """``[(token ids, log-probs)]`` per prompt (sampled with the adapter ``lora``, None: the weights alone), stepping
    the engine so that ``stop_event`` (None: no stop) can end every row at once, and ``beat`` (the heartbeat) is
    called between steps."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, seed in zip(ids, prompts, seeds):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(**params, seed=seed), lora_request=lora)
    latest: dict[str, object] = {}
    while engine.has_unfinished_requests():
        if stop_event is not None and stop_event.is_set():
            engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
            break
        for out in engine.step():
            latest[out.request_id] = out
        if beat is not None:
            beat()
    samples = []
    for rid in ids:
        out = latest.get(rid)
        if out is None:
            samples.append(([], []))
            continue
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logps = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs or [])]
        samples.append((tokens, logps))
    return samples
