"""The child process of :class:`~rloo_lightning.engines.vllm.VLLMEngine`: everything that runs in it.

:func:`_serve` is the target the trainer spawns (``spawn`` imports it by this module's path in the child): it builds
vLLM's engine, then answers ``push`` / ``generate`` / ``stats`` requests on its pipe until ``close``;
:func:`_generate` steps the engine so that a stop signal can end every row at once; :class:`_HarmlessVLLMRecords`
drops two vLLM warnings that read like failures. vLLM is imported only inside these functions, in the child: the
trainer's process never imports it.
"""

from __future__ import annotations

import logging
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


def _serve(conn, stop_event) -> None:
    """The child: build the engine, then answer ``push`` / ``generate`` requests until ``close``."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer decides when to stop, and stops this process
    sigterm.ignore_sigint()
    llm, buffers = None, None
    while True:
        try:
            verb, args = conn.recv()
        except EOFError:
            return
        if verb == "close":
            return
        try:
            if verb == "build":
                from vllm import LLM, ModelRegistry

                _HarmlessVLLMRecords.install()
                supported = set(ModelRegistry.get_supported_archs())
                if not any(a in supported for a in args[1]):
                    conn.send(("refused", f"VLLMEngine: vLLM does not support the policy's architecture {args[1]}; "
                                          "use the default engine (generation_engine: null)"))
                    continue
                llm = LLM(**args[0])
                value = None
            elif verb == "push":
                if args[0] is not None:
                    buffers = args[0]
                if getattr(llm, "_rloo_asleep", False):
                    llm.wake_up()
                    llm._rloo_asleep = False
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(buffers)})
                llm.reset_prefix_cache()  # no KV block computed with the old weights is reused
                value = None
            elif verb == "stats":
                import resource

                value = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            elif verb == "generate":
                value = _generate(llm, *args[:3], stop_event)
                if args[3]:
                    llm.sleep(level=args[3])
                    llm._rloo_asleep = True
            else:
                raise ValueError(f"unknown request {verb!r}")
            conn.send(("ok", value))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _generate(llm, prompts: list[list[int]], params: dict, seeds: list[int], stop_event) -> list:
    """``[(token ids, log-probs)]`` per prompt, stepping the engine so that a stop can end every row at once."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, seed in zip(ids, prompts, seeds):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(**params, seed=seed))
    latest: dict[str, object] = {}
    while engine.has_unfinished_requests():
        if stop_event.is_set():
            engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
            break
        for out in engine.step():
            latest[out.request_id] = out
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
