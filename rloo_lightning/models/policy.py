"""The policy and its reference: loading options (checkpointing, LoRA, dropout), the frozen copy, export."""

from __future__ import annotations

import copy

import torch

from rloo_lightning.config import PolicyArgs

__all__ = ["Frozen", "lora_config", "load_models", "check_checkpoint_fits", "prepare_policy", "disable_dropout",
           "export_pretrained"]


class Frozen:
    """Holds a frozen model outside the registered submodules: never trained, wrapped or checkpointed by Lightning."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval().requires_grad_(False)


def lora_config(options: dict):
    """``peft.LoraConfig`` for a causal LM from the ``policy.lora`` option, with errors that name it."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("the policy.lora option needs peft: pip install 'rloo-lightning[lora]'") from err
    try:
        return LoraConfig(task_type="CAUSAL_LM", **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"policy.lora={options!r} is not a valid peft.LoraConfig: {err}") from err


def load_models(name_or_path: str, args: PolicyArgs, with_reference: bool, strategy=None):
    """``(policy, tokenizer, reference or None)`` loaded from ``name_or_path``.

    The reference is loaded here only under DeepSpeed ZeRO-3, which partitions the policy as it loads;
    elsewhere it is a copy of the policy made by the module (a GGUF load dequantizes: copying is cheaper).
    """
    from rloo_lightning.models import sharding
    from rloo_lightning.models.loading import load_causal_lm, load_tokenizer

    load = dict(gguf_file=args.gguf_file, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(name_or_path, **load)
    with sharding.pretrained_init_context(strategy):  # ZeRO-3: loaded into its partitions; else a no-op
        policy = load_causal_lm(name_or_path, **load)
    reference = None
    if with_reference and not args.lora and sharding.is_zero3(strategy):
        with sharding.replicated_init_context(strategy):
            reference = load_causal_lm(name_or_path, **load)
    return policy, tokenizer, reference


def check_checkpoint_fits(checkpoint: dict, state: dict, model_name_or_path: str, absent_ok=frozenset()) -> None:
    """A checkpoint of another model, in one line before any of its tensors is loaded (``load_state_dict`` would
    list every tensor that differs, naming neither model): the checkpoint's ``model_name_or_path``, this run's, and
    the first tensor whose shape differs, else the first policy tensor only one of them has.

    Args:
        checkpoint: a module checkpoint (``state_dict``, ``hyper_parameters``); one without ``state_dict`` (a
            sharded one, loaded by its strategy) is not checked.
        state: this module's ``state_dict(keep_vars=True)`` (a DeepSpeed ZeRO-3 parameter's shape is ``ds_shape``).
        absent_ok: keys a checkpoint may lack (LoRA's frozen base weights: the base model on disk holds them).
    """
    theirs = checkpoint.get("state_dict")
    if not isinstance(theirs, dict):
        return

    def shape(tensor) -> list[int]:
        return list(getattr(tensor, "ds_shape", None) or tensor.shape)

    trained_on = (checkpoint.get("hyper_parameters") or {}).get("model_name_or_path")
    differ = [key for key in theirs if key in state and shape(theirs[key]) != shape(state[key])]
    only_there = [key for key in theirs if key.startswith("policy.") and key not in state]
    only_here = [key for key in state if key.startswith("policy.") and key not in theirs and key not in absent_ok]
    if differ:
        why = f"{differ[0]} is {shape(theirs[differ[0]])} in the checkpoint, {shape(state[differ[0]])} here"
    elif only_there:
        why = f"the checkpoint has {only_there[0]}, this model has not"
    elif only_here:
        why = f"this model has {only_here[0]}, the checkpoint has not"
    else:
        return
    more = len(differ) + len(only_there) + len(only_here) - 1
    why += f" ({more} more tensors differ)" if more else ""
    raise ValueError(f"the checkpoint is of model_name_or_path {trained_on!r}, and this run's model "
                     f"{model_name_or_path!r} does not fit it: {why}; give model.model_name_or_path the model it "
                     "was trained from, or a checkpoint of this model")


def prepare_policy(policy: torch.nn.Module, args: PolicyArgs) -> torch.nn.Module:
    """Gradient checkpointing, the LoRA adapter and train mode on a loaded policy; returns the model to train."""
    if args.gradient_checkpointing:
        # Non-reentrant: works with inputs that need no grad and with DDP; only active in train mode.
        kwargs = {"use_reentrant": False}
        if hasattr(policy, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if args.lora:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(args.lora))
    # from_pretrained returns eval mode and Lightning does not call .train(): set it.
    return policy.train()


def disable_dropout(*models: torch.nn.Module | None) -> None:
    """Every dropout off, so that the update's log-probs are those of the sampler."""
    for model in models:
        for m in model.modules() if model is not None else ():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0


def export_pretrained(policy: torch.nn.Module, tokenizer, directory: str, args: PolicyArgs,
                      is_global_zero: bool = True) -> None:
    """Write the policy and tokenizer in Hugging Face format (``from_pretrained`` loads it).

    A LoRA policy is written merged into its base or as the adapter alone (``policy.lora_export``).
    A sharded (FSDP2) policy's full weights are gathered first, on every rank (a collective); only
    the rank with ``is_global_zero`` writes.
    """
    full_state = None
    if any(hasattr(p, "full_tensor") for p in policy.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full_state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return
    model = policy
    if args.lora and args.lora_export == "adapter":
        model.save_pretrained(directory)  # adapter_config.json + adapter weights
        tokenizer.save_pretrained(directory)
        return
    if args.lora:
        model = copy.deepcopy(model).merge_and_unload()
    if args.gguf_file or full_state is not None:
        # A GGUF-loaded model refuses save_pretrained, and a sharded one holds shards: rebuild it
        # from its config and copy the (gathered) weights in.
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(model.config)
        # The weights written are dequantized: a kept `quantization_config: gguf` would make the
        # export look quantized (HF's Trainer then refuses to fine-tune it).
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        rebuilt = AutoModelForCausalLM.from_config(config)
        rebuilt.load_state_dict(full_state if full_state is not None else model.state_dict())
        model = rebuilt
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
